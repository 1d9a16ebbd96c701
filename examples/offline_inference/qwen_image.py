"""Generate (or edit) an image with Qwen-Image through `Omni`.

    .venv/bin/python examples/offline_inference/qwen_image.py                      # tiny/qwen-image, CPU
    .venv/bin/python examples/offline_inference/qwen_image.py --edit               # tiny/qwen-image-edit
    python examples/offline_inference/qwen_image.py --model Qwen/Qwen-Image --height 1024 --width 1024 --steps 50
                                           # GPU: compiled blocks, fused kernels, CUDA graphs (--enforce-eager: not)
"""

from __future__ import annotations

import argparse

import numpy as np
from PIL import Image

from vllm_omni import Omni, OmniDiffusionSamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or path (default: the tiny checkpoint)")
    parser.add_argument("--edit", action="store_true", help="Qwen-Image-Edit: edit --image (or a random one)")
    parser.add_argument("--image", default=None, help="input image for --edit")
    parser.add_argument("--prompt", default="a cat holding a sign that says hello world")
    parser.add_argument("--negative-prompt", default=" ", help="true CFG runs when given and --cfg > 1")
    parser.add_argument("--cfg", type=float, default=4.0, help="true_cfg_scale")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention-backend", default=None, help="TORCH_SDPA, CUDNN_ATTN, FLASH_ATTN, ...")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                        help="unset: compiled on CUDA, eager on CPU (docs/diffusion_runtime.md)")
    parser.add_argument("--out", default="qwen_image.png")
    args = parser.parse_args()

    model = args.model or ("tiny/qwen-image-edit" if args.edit else "tiny/qwen-image")
    prompt: str | dict = args.prompt
    if args.edit:
        image = Image.open(args.image) if args.image else Image.fromarray(
            (np.random.RandomState(0).rand(48, 64, 3) * 255).astype("uint8"))
        prompt = {"prompt": args.prompt, "multi_modal_data": {"image": image}}
    params = OmniDiffusionSamplingParams(height=args.height, width=args.width, num_inference_steps=args.steps,
                                         true_cfg_scale=args.cfg, negative_prompt=args.negative_prompt,
                                         seed=args.seed)
    eager = {} if args.enforce_eager is None else {"enforce_eager": args.enforce_eager}
    omni = Omni(model=model, diffusion_attention_backend=args.attention_backend, **eager)
    try:
        output = omni.generate([prompt], params)[0]
        if output.error:
            raise SystemExit(f"request failed: {output.error}")
        output.images[0].save(args.out)
        print(f"saved {args.out} ({output.images[0].size[0]}x{output.images[0].size[1]}); "
              f"stage durations: {output.stage_durations}")
    finally:
        omni.close()


if __name__ == "__main__":
    main()
