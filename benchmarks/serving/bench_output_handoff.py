"""The frontend's CPU cost of streaming tokens: `AsyncOmni` vs vLLM's `AsyncLLM`, in-process, same tiny model.

Both run their EngineCore in its own process, so this process's CPU time is the frontend's alone: for vLLM its
output handler and the per-request collectors; for omni also the orchestrator thread and the hand-off of each
output to the caller's event loop (issue 18: the cost behind `vllm serve --omni`'s request throughput). N
concurrent streams of `--output-len` tokens (DELTA outputs, as vLLM's streaming chat asks), rounds alternating
AsyncLLM / AsyncOmni (ABBA) so a load trend hits both. Reported per round and as medians: this process's CPU
microseconds per streamed token (all threads, and the orchestrator thread alone) and wall time per round. Writes
benchmarks/results/bench_output_handoff-<UTC>.json and a PNG chart (CPU per token per round, both sides).

    .venv/bin/python benchmarks/serving/bench_output_handoff.py [--rounds 6] [--streams 8] [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 8, "enforce_eager": True,
               "gpu_memory_utilization": 0.15, "seed": 0}


def thread_cpu_s(name: str) -> float:
    """CPU seconds (user + system) of this process's thread called `name` (0 if there is none)."""
    for thread in threading.enumerate():
        if thread.name == name and thread.native_id is not None:
            fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


async def stream_all(generate, args: argparse.Namespace, tag: str) -> int:
    """`args.requests` requests, `args.streams` at a time; the number of outputs received."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, min_tokens=args.output_len,
                            ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    prompt = {"prompt_token_ids": list(range(100, 100 + args.input_len))}
    gate = asyncio.Semaphore(args.streams)
    received = 0

    async def one(i: int) -> None:
        nonlocal received
        async with gate:
            async for _ in generate(prompt, params, f"{tag}-{i}"):
                received += 1

    await asyncio.gather(*(one(i) for i in range(args.requests)))
    return received


async def measure(name: str, generate, args: argparse.Namespace, round_id: int) -> dict:
    tokens = args.requests * args.output_len
    cpu0, orch0, wall0 = time.process_time(), thread_cpu_s("OmniOrchestrator"), time.perf_counter()
    received = await stream_all(generate, args, f"{name}-{round_id}")
    cpu, orch, wall = time.process_time() - cpu0, thread_cpu_s("OmniOrchestrator") - orch0, time.perf_counter() - wall0
    return {"cpu_us_per_token": cpu * 1e6 / tokens, "orchestrator_cpu_us_per_token": orch * 1e6 / tokens,
            "wall_s": wall, "outputs_per_request": received / args.requests}


async def main_async(args: argparse.Namespace) -> dict:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_omni import AsyncOmni
    from vllm_omni.catalog.tiny import resolve_model

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=resolve_model("tiny/qwen2"), **ENGINE_ARGS))
    omni = AsyncOmni("tiny/qwen2", **ENGINE_ARGS)

    def omni_generate(prompt, params, rid):
        return omni.generate(prompt, rid, [params])

    sides = {"vllm": llm.generate, "omni": omni_generate}
    try:
        for name, generate in sides.items():  # warm-up
            await stream_all(generate, argparse.Namespace(**{**vars(args), "requests": args.streams}), f"warm-{name}")
        rounds = []
        for i in range(args.rounds):
            order = ("vllm", "omni") if i % 2 == 0 else ("omni", "vllm")
            result = {name: await measure(name, sides[name], args, i) for name in order}
            result["cpu_ratio"] = result["omni"]["cpu_us_per_token"] / result["vllm"]["cpu_us_per_token"]
            result["wall_ratio"] = result["omni"]["wall_s"] / result["vllm"]["wall_s"]
            rounds.append(result)
            print(f"round {i}: cpu/token vllm {result['vllm']['cpu_us_per_token']:.0f} us, omni "
                  f"{result['omni']['cpu_us_per_token']:.0f} us (orchestrator thread "
                  f"{result['omni']['orchestrator_cpu_us_per_token']:.0f} us), ratio {result['cpu_ratio']:.3f}x; "
                  f"wall ratio {result['wall_ratio']:.3f}x", flush=True)
    finally:
        omni.close()
        llm.shutdown()
    medians = {key: statistics.median(r[key] for r in rounds) for key in ("cpu_ratio", "wall_ratio")}
    for name in sides:
        for key in ("cpu_us_per_token", "orchestrator_cpu_us_per_token", "wall_s", "outputs_per_request"):
            medians[f"{name}_{key}"] = statistics.median(r[name][key] for r in rounds)
    return {"workload": vars(args), "rounds": rounds, "median": medians}


def plot(path: Path, rounds: list[dict]) -> None:
    """Per round: a bar for vLLM's and one for omni's CPU microseconds per token (PIL, as the other serving
    benchmark: no plotting library needed)."""
    from PIL import Image, ImageDraw

    width, height, margin = 640, 360, 50
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    top = max(r[name]["cpu_us_per_token"] for r in rounds for name in ("vllm", "omni")) * 1.15
    slot = (width - margin - 20) / len(rounds)
    for i, r in enumerate(rounds):
        for j, (name, color) in enumerate((("vllm", "gray"), ("omni", "steelblue"))):
            value = r[name]["cpu_us_per_token"]
            x0 = margin + i * slot + slot * (0.15 + 0.35 * j)
            y0 = height - margin - (height - 2 * margin) * value / top
            draw.rectangle([x0, y0, x0 + slot * 0.3, height - margin], fill=color)
            draw.text((x0, y0 - 12), f"{value:.0f}", fill="black")
        draw.text((margin + i * slot + slot * 0.3, height - margin + 8), f"round {i}", fill="black")
    draw.text((margin, 10), "frontend CPU us per streamed token: AsyncLLM (gray) vs AsyncOmni (blue)", fill="black")
    image.save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--streams", type=int, default=8, help="concurrent requests")
    parser.add_argument("--requests", type=int, default=64, help="per side and round")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = asyncio.run(main_async(args))
    print(json.dumps(result["median"], indent=2))
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = ROOT / "benchmarks" / "results" / f"bench_output_handoff-{stamp}.json"
    out.write_text(json.dumps(result, indent=2))
    plot(out.with_suffix(".png"), result["rounds"])
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
