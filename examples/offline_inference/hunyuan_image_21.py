"""Generate an image with HunyuanImage-2.1 through `Omni`: a bare prompt runs the checkpoint's defaults (50 steps
with its CFG/APG guider; the Distilled checkpoint 8 steps with embedded guidance 3.25); quoted text in the prompt
goes through the ByT5 glyph encoder. Only size and steps are passed here so the tiny checkpoint finishes in seconds.

    .venv/bin/python examples/offline_inference/hunyuan_image_21.py              # tiny/hunyuan-image-2.1, CPU
    python examples/offline_inference/hunyuan_image_21.py --model hunyuanvideo-community/HunyuanImage-2.1-Diffusers \
        --height 2048 --width 2048 --steps 50
"""

from __future__ import annotations

import argparse

from vllm_omni import Omni, OmniDiffusionSamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny/hunyuan-image-2.1",
                        help="hub id or path (default: the tiny checkpoint)")
    parser.add_argument("--prompt", default='a neon shop sign that says "OPEN LATE" on a rainy street at night')
    parser.add_argument("--negative-prompt", default=None, help="read only with CFG (the undistilled model)")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4, help="None: the checkpoint's (50, Distilled: 8)")
    parser.add_argument("--guidance", type=float, default=None,
                        help="the guider's CFG scale (Distilled: the embedded guidance); default: the checkpoint's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="hunyuan_image_21.png")
    args = parser.parse_args()

    params = OmniDiffusionSamplingParams(height=args.height, width=args.width, num_inference_steps=args.steps,
                                         guidance_scale=args.guidance, seed=args.seed)
    prompt = {"prompt": args.prompt, "negative_prompt": args.negative_prompt} if args.negative_prompt else args.prompt
    omni = Omni(model=args.model)
    try:
        output = omni.generate([prompt], params)[0]
        if output.error:
            raise SystemExit(f"request failed: {output.error}")
        output.images[0].save(args.out)
        print(f"saved {args.out} ({output.images[0].size[0]}x{output.images[0].size[1]})")
        print(f"stage durations: {output.stage_durations}")
    finally:
        omni.close()


if __name__ == "__main__":
    main()
