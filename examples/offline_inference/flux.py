"""Generate an image with FLUX.1-dev through `Omni`.

    .venv/bin/python examples/offline_inference/flux.py                  # tiny/flux, CPU, seconds
    python examples/offline_inference/flux.py --model black-forest-labs/FLUX.1-dev --height 1024 --width 1024 \
        --steps 28 --no-enforce-eager                                    # GPU: compiled blocks + CUDA graphs
"""

from __future__ import annotations

import argparse

from vllm_omni import Omni, OmniDiffusionSamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny/flux", help="hub id or path (default: the tiny checkpoint)")
    parser.add_argument("--prompt", default="a cat holding a sign that says hello world")
    parser.add_argument("--guidance", type=float, default=3.5, help="distilled guidance_scale")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-images", type=int, default=1)
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-enforce-eager compiles the transformer blocks and replays CUDA graphs (GPU)")
    parser.add_argument("--attention-backend", default=None, help="TORCH_SDPA, CUDNN_ATTN, FLASH_ATTN, ...")
    parser.add_argument("--out", default="flux.png")
    args = parser.parse_args()

    params = OmniDiffusionSamplingParams(height=args.height, width=args.width, num_inference_steps=args.steps,
                                         guidance_scale=args.guidance, seed=args.seed,
                                         num_outputs_per_prompt=args.num_images)
    omni = Omni(model=args.model, enforce_eager=args.enforce_eager,
                diffusion_attention_backend=args.attention_backend)
    try:
        output = omni.generate([args.prompt], params)[0]
        if output.error:
            raise SystemExit(f"request failed: {output.error}")
        for i, image in enumerate(output.images):
            path = args.out if i == 0 else args.out.replace(".png", f"_{i}.png")
            image.save(path)
            print(f"saved {path} ({image.size[0]}x{image.size[1]})")
        print(f"stage durations: {output.stage_durations}")
    finally:
        omni.close()


if __name__ == "__main__":
    main()
