"""One diffusion request spread over several worker processes: sequence (Ulysses / ring / AllGather-KV), CFG, tensor
and VAE patch parallel.

    .venv/bin/python examples/offline_inference/parallel_diffusion.py                      # Ulysses 2 on CPU
    .venv/bin/python examples/offline_inference/parallel_diffusion.py --ring 2 --compare   # ring 2, check vs 1 rank
    .venv/bin/python examples/offline_inference/parallel_diffusion.py --cfg 2 --ulysses 2  # 4 ranks
    .venv/bin/python examples/offline_inference/parallel_diffusion.py --vae 2 --compare    # decode split in 2 strips
    .venv/bin/python examples/offline_inference/parallel_diffusion.py --ulysses 1 --allgather 2 --compare
    .venv/bin/python examples/offline_inference/parallel_diffusion.py --model tiny/wan2.1-t2v --vae 2 --compare
    python examples/offline_inference/parallel_diffusion.py --model Qwen/Qwen-Image --size 1024 --steps 50 --ulysses 2

The stage starts max(ulysses x ring x allgather x cfg x tp, vae) worker processes (gloo on CPU, NCCL on GPUs). With
--compare the same request also runs on one rank and the script prints the PSNR between the two outputs
(identical up to float rounding). See docs/parallelism.md for what to choose.
"""

from __future__ import annotations

import argparse

import numpy as np

from vllm_omni import Omni, OmniDiffusionSamplingParams


def generate(model: str, params: OmniDiffusionSamplingParams, **parallel: int) -> np.ndarray:
    omni = Omni(model=model, **parallel)
    try:
        (out,) = omni.generate(["a lighthouse at dusk, oil painting"], params)
    finally:
        omni.close()
    if out.error:
        raise SystemExit(f"generation failed: {out.error}")
    print(f"{parallel or 'one rank'}: " + ", ".join(f"{k}={v:.2f}s" for k, v in sorted(out.stage_durations.items())))
    video = (out.multimodal_output or {}).get("video")  # Wan: uint8 frames; images: PIL
    return np.asarray(out.images[0] if video is None else video, dtype=np.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny/qwen-image")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ulysses", type=int, default=2)
    parser.add_argument("--ring", type=int, default=1)
    parser.add_argument("--allgather", type=int, default=1, help="AllGather-KV degree (not with --ring)")
    parser.add_argument("--ulysses-mode", default="strict", choices=["strict", "advanced_uaa"],
                        help="advanced_uaa: pad the heads when --ulysses does not divide them")
    parser.add_argument("--cfg", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--vae", type=int, default=1, help="VAE patch-parallel degree (Qwen-Image, Wan)")
    parser.add_argument("--compare", action="store_true", help="also run on one rank and print the PSNR")
    args = parser.parse_args()

    video = "wan" in args.model.lower()
    params = OmniDiffusionSamplingParams(height=args.size, width=args.size, num_inference_steps=args.steps,
                                         negative_prompt="blurry", seed=0,
                                         **({"num_frames": 5} if video else {"true_cfg_scale": 4.0}))
    image = generate(args.model, params, ulysses_degree=args.ulysses, ring_degree=args.ring,
                     allgather_degree=args.allgather, ulysses_mode=args.ulysses_mode, cfg_parallel_size=args.cfg,
                     tensor_parallel_size=args.tp, vae_patch_parallel_size=args.vae)
    if args.compare:
        mse = np.mean((image - generate(args.model, params)) ** 2)
        print("PSNR vs one rank: " + ("identical" if mse == 0 else f"{10 * np.log10(255.0**2 / mse):.1f} dB"))


if __name__ == "__main__":
    main()
