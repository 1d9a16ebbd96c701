"""The same prompt and seed at each request quality (docs/cache.md): what the cache ran, the time, and how far
each output is from `lossless`.

    .venv/bin/python examples/offline_inference/cache_quality.py                            # tiny/qwen-image, CPU
    .venv/bin/python examples/offline_inference/cache_quality.py --cache-backend cache_dit  # cache-dit's DBCache
    python examples/offline_inference/cache_quality.py --model Qwen/Qwen-Image --size 1024 --steps 50 \
        --cache-config '{"rel_l1_thresh": 0.2}'            # GPU; a custom adaptive TeaCache request too
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from vllm_omni import Omni, OmniDiffusionSamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny/qwen-image")
    parser.add_argument("--prompt", default="a cat holding a sign that says hello world")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--cache-backend", default="tea_cache", choices=["none", "tea_cache", "cache_dit"])
    parser.add_argument("--cache-config", type=json.loads, default=None,
                        help="also run one request with this cache_config override (JSON)")
    args = parser.parse_args()

    runs: list[tuple[str, dict]] = [("lossless", {"quality": "lossless"}), ("high", {"quality": "high"}),
                                    ("fast", {"quality": "fast"})]
    if args.cache_config:
        runs.append(("custom", {"cache_config": args.cache_config}))
    omni = Omni(model=args.model, cache_backend=args.cache_backend)
    try:
        reference = None
        for label, knobs in runs:
            params = OmniDiffusionSamplingParams(height=args.size, width=args.size, num_inference_steps=args.steps,
                                                 negative_prompt=" ", seed=0, **knobs)
            start = time.perf_counter()
            output = omni.generate([args.prompt], params)[0]
            seconds = time.perf_counter() - start
            if output.error:
                raise SystemExit(f"{label} failed: {output.error}")
            image = np.asarray(output.images[0], dtype=np.float64)
            reference = image if reference is None else reference
            mse = float(np.mean((image - reference) ** 2))
            psnr = float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
            output.images[0].save(f"cache_quality_{label}.png")
            cache = output.cache
            print(f"{label:<9} {seconds:6.2f} s  backend={cache['backend']:<9} reused {cache['reused_steps']}/"
                  f"{cache['reused_steps'] + cache['computed_steps']} steps "
                  f"({cache['reused_block_steps']} block-steps)  PSNR vs lossless {psnr:.1f} dB")
    finally:
        omni.close()


if __name__ == "__main__":
    main()
