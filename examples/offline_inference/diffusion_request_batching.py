"""Several prompts co-batched into one diffusion forward, and any diffusers model through the adapter.

    .venv/bin/python examples/offline_inference/diffusion_request_batching.py
    .venv/bin/python examples/offline_inference/diffusion_request_batching.py --diffusers-adapter
    .venv/bin/python examples/offline_inference/diffusion_request_batching.py --step-execution
    python examples/offline_inference/diffusion_request_batching.py --step-execution --max-tokens-per-forward 1
    python examples/offline_inference/diffusion_request_batching.py --model Qwen/Qwen-Image --size 1024 --steps 50
    .venv/bin/python examples/offline_inference/diffusion_request_batching.py --memory-budget-gb 0.02

Requests with the same sampling-params key (size, steps, CFG, quality, ...) but different prompts and seeds
share a forward, up to --max-num-seqs, waiting at most --batch-wait-ms for the batch to fill. With
--step-execution the worker instead admits each request at the next denoise-step boundary (up to
--max-num-seqs resident); resident requests of the same size share one transformer forward per step, up to
--max-tokens-per-forward tokens (1 = one forward per request; see "Execution modes" in
docs/diffusion_runtime.md). With --memory-budget-gb the scheduler admits only what the budget holds (by each
request's estimated memory at its shape; docs/serving.md "Memory admission"): 0.02 GiB holds two of the tiny
64x64 CFG requests, so the four prompts run as two batches of two (the later two queue ~2 s on CPU), and each
output says what was reserved beside it when it left.
"""

from __future__ import annotations

import argparse

from vllm_omni import Omni, OmniDiffusionSamplingParams

PROMPTS = ["a lighthouse at dusk", "a red bicycle in the rain", "a bowl of ramen, top view", "a snowy forest"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny/qwen-image")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--batch-wait-ms", type=float, default=200.0)
    parser.add_argument("--diffusers-adapter", action="store_true",
                        help="run the model with plain diffusers inside the runtime (one request per forward)")
    parser.add_argument("--step-execution", action="store_true",
                        help="admit and retire requests at every denoise step instead of batching whole requests")
    parser.add_argument("--max-tokens-per-forward", type=int, default=16384,
                        help="step mode: most tokens in one co-batched transformer forward (1 = one per request)")
    parser.add_argument("--memory-budget-gb", type=float, default=None,
                        help="memory admission budget of the requests together (default: free device memory on CUDA, "
                             "none on CPU)")
    args = parser.parse_args()

    params = OmniDiffusionSamplingParams(height=args.size, width=args.size, num_inference_steps=args.steps,
                                         true_cfg_scale=4.0, negative_prompt="blurry", seed=0)
    omni = Omni(
        model=args.model,
        max_num_seqs=1 if args.diffusers_adapter else args.max_num_seqs,
        request_batch_max_wait_ms=0.0 if args.step_execution else args.batch_wait_ms,  # step mode has no batch wait
        use_diffusers_adapter=args.diffusers_adapter,
        step_execution=args.step_execution,
        diffusion_max_tokens_per_forward=args.max_tokens_per_forward,
        diffusion_memory_budget_gb=args.memory_budget_gb,
    )
    try:
        outputs = omni.generate(PROMPTS, params)  # all prompts are queued at once, so they can share a forward
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            if out.error:
                raise SystemExit(f"{prompt!r} failed: {out.error}")
            name = f"batching_{prompt.split()[1]}.png"
            out.images[0].save(name)
            timings = ", ".join(f"{k}={v * 1000:.0f}ms" for k, v in sorted(out.stage_durations.items()))
            stats = out.step_stats
            memory = (f", reserved beside it {stats.reserved_bytes / 2**20:.1f} of {stats.budget_bytes / 2**20:.1f} MiB"
                      if stats is not None and stats.budget_bytes is not None else "")
            print(f"{name}: {timings}{memory}")
    finally:
        omni.close()


if __name__ == "__main__":
    main()
