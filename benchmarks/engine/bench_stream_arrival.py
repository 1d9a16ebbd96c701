"""Streamed outputs of one AR stage through `AsyncOmni` vs plain vLLM `AsyncLLM`: do they reach the caller one
engine step at a time, or in bursts? Same process, same tiny Qwen2 weights, rounds alternating the engines.

Per engine and round: `--concurrency` streamed greedy requests of `--tokens` tokens; for each request the outputs
the caller read, the most tokens one output carried (vLLM merges what a lagging reader has not taken), the outputs
read after vLLM had finished the request (what a pump or queue holding outputs back would show) and the event
loop's lag (a 1 ms ticker). Prints a table and writes JSON to benchmarks/results/.

  .venv/bin/python benchmarks/engine/bench_stream_arrival.py --tokens 1000 --concurrency 1 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ENGINE_KWARGS = dict(dtype="float32", max_model_len=2048, enforce_eager=True, gpu_memory_utilization=0.15, seed=0)


async def run(args: argparse.Namespace) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_omni import AsyncOmni
    from vllm_omni.catalog.tiny import resolve_model

    kwargs = {**ENGINE_KWARGS, "max_num_seqs": max(args.concurrency, 1)}
    plain = AsyncLLM.from_engine_args(AsyncEngineArgs(model=resolve_model("tiny/qwen2"), **kwargs))
    omni = AsyncOmni("tiny/qwen2", **kwargs)
    # What each server streams with: vLLM's chat asks for DELTA outputs, ours for CUMULATIVE (serving_chat.py).
    engines = {
        "vllm_asyncllm": (lambda rid, p: plain.generate("hi", p, rid), RequestOutputKind.DELTA,
                          plain.output_processor.external_req_ids),
        "asyncomni": (lambda rid, p: omni.generate("hi", rid, [p]), RequestOutputKind.CUMULATIVE,
                      omni.engine.stage_clients[0].llm.output_processor.external_req_ids),
    }

    async def one(name: str, rid: str) -> dict:
        generate, kind, held = engines[name]
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0, output_kind=kind)
        seen, per_output, late = 0, [], 0
        async for out in generate(rid, params):
            ids = out.outputs[0].token_ids if name == "vllm_asyncllm" else out.token_ids
            total = seen + len(ids) if kind == RequestOutputKind.DELTA else len(ids)
            per_output.append(total - seen)
            seen = total
            finished = out.finished
            late += not finished and not held.get(rid)
        return {"outputs": len(per_output), "max_tokens_per_output": max(per_output), "read_after_finish": late,
                "tokens": seen}

    async def measure(name: str, r: int) -> dict:
        lags: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                start = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - start - 0.001)

        tick = asyncio.create_task(ticker())
        start = time.perf_counter()
        requests = await asyncio.gather(*(one(name, f"{name}-{r}-{i}") for i in range(args.concurrency)))
        elapsed = time.perf_counter() - start
        stop.set()
        await tick
        lags.sort()
        return {"elapsed_s": elapsed, "requests": requests, "loop_lag_ms": {
            "median": lags[len(lags) // 2] * 1e3, "p99": lags[int(len(lags) * 0.99)] * 1e3, "max": lags[-1] * 1e3}}

    results: dict[str, list[dict]] = {name: [] for name in engines}
    try:
        for name in engines:  # warm-up
            await one(name, f"{name}-warm")
        for r in range(args.rounds):
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                results[name].append(await measure(name, r))
    finally:
        omni.close()
        plain.shutdown()
    return {"tokens": args.tokens, "concurrency": args.concurrency, "rounds": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = asyncio.run(run(args))

    print(f"\n{'engine':<15}{'round':>6}{'s':>7}{'outputs/req':>12}{'max tok/out':>12}{'read late':>10}"
          f"{'lag p99 ms':>11}{'lag max ms':>11}")
    for name, rounds in result["rounds"].items():
        for r, row in enumerate(rounds):
            reqs = row["requests"]
            print(f"{name:<15}{r:>6}{row['elapsed_s']:>7.2f}{statistics.mean(q['outputs'] for q in reqs):>12.0f}"
                  f"{max(q['max_tokens_per_output'] for q in reqs):>12}{sum(q['read_after_finish'] for q in reqs):>10}"
                  f"{row['loop_lag_ms']['p99']:>11.2f}{row['loop_lag_ms']['max']:>11.1f}")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or Path(__file__).parents[1] / "results" / f"bench_stream_arrival-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "command": " ".join(sys.argv), "python": platform.python_version(),
                               "machine": platform.machine(), "cpus": os.cpu_count(),
                               "loadavg": os.getloadavg()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
