"""Fit Qwen-Image where memory is short: layerwise offload, online FP8, or DLO across data-parallel ranks.

    .venv/bin/python examples/offline_inference/memory.py --mode offload     # tiny/qwen-image, CPU
    .venv/bin/python examples/offline_inference/memory.py --mode fp8
    .venv/bin/python examples/offline_inference/memory.py --mode dlo         # 2 CPU ranks, 2 prompts at once
    python examples/offline_inference/memory.py --model Qwen/Qwen-Image --mode offload --size 1024 --steps 50

offload: --enable-layerwise-offload (DiT blocks streamed from pinned host memory, one block ahead) and
--enable-cpu-offload (text encoder and VAE on the device only while they run). fp8: --quantization fp8.
dlo: --data-parallel-size 2 --enable-distributed-layerwise-offload (each rank keeps half of every block; the two
prompts run one per rank). See docs/memory.md for which fits which GPU.
"""

from __future__ import annotations

import argparse

from vllm_omni import Omni, OmniDiffusionSamplingParams

MODES = {
    "offload": dict(enable_layerwise_offload=True, offload_resident_layers=1, enable_cpu_offload=True),
    "fp8": dict(quantization="fp8"),
    "dlo": dict(data_parallel_size=2, enable_distributed_layerwise_offload=True, request_batch_max_wait_ms=1000),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny/qwen-image")
    parser.add_argument("--mode", choices=sorted(MODES), default="offload")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    params = OmniDiffusionSamplingParams(height=args.size, width=args.size, num_inference_steps=args.steps,
                                         true_cfg_scale=4.0, negative_prompt=" ", seed=0)
    prompts = ["a lighthouse at dusk", "a red fox in the snow"]
    omni = Omni(model=args.model, **MODES[args.mode])
    try:
        for i, output in enumerate(omni.generate(prompts, params)):
            if output.error:
                raise SystemExit(f"request failed: {output.error}")
            path = f"memory_{args.mode}_{i}.png"
            output.images[0].save(path)
            print(f"saved {path}; peak memory {output.peak_memory_mb:.0f} MB; {output.stage_durations}")
    finally:
        omni.close()


if __name__ == "__main__":
    main()
