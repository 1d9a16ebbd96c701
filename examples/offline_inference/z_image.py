"""Generate an image with Z-Image-Turbo through `Omni`: a bare prompt runs the distilled defaults (9 steps, no
CFG); only the size is passed here so the tiny checkpoint finishes in seconds.

    .venv/bin/python examples/offline_inference/z_image.py                  # tiny/z-image-turbo, CPU
    python examples/offline_inference/z_image.py --model Tongyi-MAI/Z-Image-Turbo --height 1024 --width 1024
"""

from __future__ import annotations

import argparse

from vllm_omni import Omni, OmniDiffusionSamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny/z-image-turbo", help="hub id or path (default: the tiny checkpoint)")
    parser.add_argument("--prompt", default="a lighthouse at dusk, oil painting")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=None, help="default: the model card's 9")
    parser.add_argument("--guidance", type=float, default=None, help="CFG scale (default 0: Turbo is distilled)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="z_image.png")
    args = parser.parse_args()

    params = OmniDiffusionSamplingParams(
        height=args.height,
        width=args.width,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        seed=args.seed,
    )
    omni = Omni(model=args.model)
    try:
        output = omni.generate([args.prompt], params)[0]
        if output.error:
            raise SystemExit(f"request failed: {output.error}")
        output.images[0].save(args.out)
        print(f"saved {args.out} ({output.images[0].size[0]}x{output.images[0].size[1]})")
        print(f"stage durations: {output.stage_durations}")
    finally:
        omni.close()


if __name__ == "__main__":
    main()
