"""Generate images with Qwen-Image-2.1 through `Omni`: two prompts in one call (each request computes its own
text K/V once and reuses it at every step); only the size and steps are passed so the tiny checkpoint finishes
in seconds. The VAE decodes RGBA. `--image in.png` conditions every prompt on that image (an edit).

    .venv/bin/python examples/offline_inference/qwen_image_21.py                  # tiny/qwen-image-2.1, CPU
    python examples/offline_inference/qwen_image_21.py --model Qwen/Qwen-Image-2.1 --height 1024 --width 1024 --steps 40
"""

from __future__ import annotations

import argparse

from vllm_omni import Omni, OmniDiffusionSamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny/qwen-image-2.1", help="hub id or path (default: the tiny checkpoint)")
    parser.add_argument("--prompt", action="append", help="repeatable (default: two example prompts)")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4, help="diffusers' default is 40")
    parser.add_argument("--true-cfg-scale", type=float, default=None, help="> 1 turns CFG on (needs --negative)")
    parser.add_argument("--negative", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image", default=None, help="a condition image (edit); default: text-to-image")
    args = parser.parse_args()

    prompts = args.prompt or ["a capybara in a wizard hat, oil painting", "a lighthouse at dusk"]
    params = OmniDiffusionSamplingParams(
        height=args.height,
        width=args.width,
        num_inference_steps=args.steps,
        true_cfg_scale=args.true_cfg_scale,
        negative_prompt=args.negative,
        seed=args.seed,
    )
    omni = Omni(model=args.model)
    try:
        if args.image:
            from PIL import Image

            image = Image.open(args.image)
            prompts = [{"prompt": p, "multi_modal_data": {"image": image}} for p in prompts]
        for i, output in enumerate(omni.generate(prompts, params)):
            if output.error:
                raise SystemExit(f"request failed: {output.error}")
            path = f"qwen_image_21_{i}.png"
            output.images[0].save(path)
            print(f"saved {path} ({output.images[0].mode} {output.images[0].size[0]}x{output.images[0].size[1]})")
    finally:
        omni.close()


if __name__ == "__main__":
    main()
