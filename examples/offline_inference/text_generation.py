"""Text generation on an AR model through `Omni` (batched) and `AsyncOmni` (streaming).

    .venv/bin/python examples/offline_inference/text_generation.py                 # tiny/qwen2 on CPU
    python examples/offline_inference/text_generation.py --model Qwen/Qwen2.5-7B-Instruct --gpu-memory-utilization 0.9
"""

from __future__ import annotations

import argparse
import asyncio

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from vllm_omni import AsyncOmni, Omni


async def stream(args: argparse.Namespace) -> None:
    omni = AsyncOmni(args.model, gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=512)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA)
        async for out in omni.generate(args.prompts[0], "stream-0", [params]):
            print(out.text, end="", flush=True)
        print(f"\nstage durations: {out.stage_durations}")
    finally:
        omni.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny/qwen2")
    parser.add_argument("--prompts", nargs="+", default=["Hello, my name is", "The capital of France is"])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.15)
    parser.add_argument("--stream", action="store_true", help="stream the first prompt with AsyncOmni")
    args = parser.parse_args()

    if args.stream:
        asyncio.run(stream(args))
        return
    with Omni(args.model, gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=512) as omni:
        outputs = omni.generate(args.prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    for prompt, out in zip(args.prompts, outputs, strict=True):
        print(f"{prompt!r} -> {out.text!r} ({len(out.token_ids)} tokens, {out.stage_durations['llm']:.3f} s)")


if __name__ == "__main__":
    main()
