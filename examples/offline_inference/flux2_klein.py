"""Generate and edit images with FLUX.2 [klein] through `Omni`: a bare prompt runs the checkpoint's defaults (the
step-distilled repos: 4 steps, no guidance); `--image` adds reference images (an edit).

    .venv/bin/python examples/offline_inference/flux2_klein.py                     # tiny/flux2-klein, CPU
    .venv/bin/python examples/offline_inference/flux2_klein.py --image in.png --prompt "make it blue"
    python examples/offline_inference/flux2_klein.py --model black-forest-labs/FLUX.2-klein-4B --height 1024 \\
        --width 1024
"""

from __future__ import annotations

import argparse

from PIL import Image

from vllm_omni import Omni, OmniDiffusionSamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny/flux2-klein", help="hub id or path (default: the tiny checkpoint)")
    parser.add_argument("--prompt", default="a lighthouse at dusk, oil painting")
    parser.add_argument("--image", action="append", default=[], help="reference image (repeat for several)")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=None, help="default: 4 (distilled) or 50 (base)")
    parser.add_argument("--guidance", type=float, default=None, help="CFG scale, base repos only (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="flux2_klein.png")
    args = parser.parse_args()

    params = OmniDiffusionSamplingParams(
        height=args.height,
        width=args.width,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        seed=args.seed,
    )
    prompt = {"prompt": args.prompt}
    if args.image:
        prompt["multi_modal_data"] = {"image": [Image.open(path).convert("RGB") for path in args.image]}
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
