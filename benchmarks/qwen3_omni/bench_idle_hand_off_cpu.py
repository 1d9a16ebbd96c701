"""Qwen3-Omni thinker -> talker hand-offs to a waiting talker (`EdgeStreamConfig.idle_chunk_growth`), on CPU.

One `AsyncOmni("tiny/qwen3-omni")` (the test suite's settings; `--size mid`: a thinker slower than its talker);
each repeat runs the same chat with audio once per growth value, in turn (A/B, then B/A, on the same engine and
machine load: the orchestrator reads the edge's config per request). Per request: time to the first audio chunk
(TTFA), end-to-end latency (E2E: the stream's end), when the thinker's last token came (did audio stream before
it?), the thinker's tokens when the first audio came (the delay in thinker steps, which load moves less than
seconds), and the requests the API process sent both AR stages' EngineCores (the thinker's request, the talker's
streaming-input chunks and its input close: tests/models/qwen3_omni/test_round_trips.py counts the same). Prints
per-run rows and the medians; `--json` writes them, with each request's timeline (its EngineCore requests, stage
outputs).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/qwen3_omni/bench_idle_hand_off_cpu.py --repeats 5
    PYTHONPATH=$PWD .venv/bin/python benchmarks/qwen3_omni/bench_idle_hand_off_cpu.py --size mid \\
        --thinker-tokens 32 200 --talker-tokens 100 300 --repeats 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
MID = {"thinker_hidden": 512, "thinker_layers": 8}
"""bench_stream_cpu.py's "mid" checkpoint."""


TIMELINE: list[tuple[float, str, int]] = []
"""The current request's events: (time, "send 0" / "send 1" (a request to that stage's EngineCore) or "out 0" /
"out 1" (an output of that stage), that stage's output tokens so far)."""


def count_requests(omni) -> Counter:
    """Counts what the API process sends the two AR stages' EngineCores (every message goes through these), and
    puts them and both stages' outputs on `TIMELINE`."""
    calls: Counter = Counter()
    for client in omni.engine.stage_clients[:2]:
        core = client.llm.engine_core
        for name in ("add_request_async", "abort_requests_async", "call_utility_async"):
            def counted(*args, _call=getattr(core, name), _name=name, _stage=client.stage_id):
                calls[(_stage, _name)] += 1
                TIMELINE.append((time.perf_counter(), f"send {_stage}", 0))
                return _call(*args)

            setattr(core, name, counted)

        async def generate(*args, _generate=client.generate, _stage=client.stage_id):
            tokens = 0
            async for out in _generate(*args):
                tokens = len(out.token_ids) if _stage == 0 else tokens + len(out.token_ids)  # talker: deltas
                TIMELINE.append((time.perf_counter(), f"out {_stage}", tokens))
                yield out

        client.generate = generate
    return calls


async def one_request(omni, prompt: dict, request_id: str, params: list, calls: Counter) -> dict:
    before = sum(calls.values())
    TIMELINE.clear()
    start = time.perf_counter()
    ttfa = None
    thinker_tokens = tokens_at_first_audio = 0
    async for out in omni.generate(prompt, request_id, params):
        now = time.perf_counter() - start
        if out.stage_id == 0:
            thinker_tokens = len(out.token_ids)
        elif out.stage_id == 2 and ttfa is None:
            ttfa, tokens_at_first_audio = now, thinker_tokens
    e2e = time.perf_counter() - start
    # The stream ends once every stage is done (a talker that said codec EOS first leaves the thinker writing).
    thinker_done = next(t for t, event, n in TIMELINE if event == "out 0" and n == params[0].max_tokens)
    return {"ttfa_s": ttfa, "e2e_s": e2e, "thinker_done_s": thinker_done - start,
            "thinker_tokens_at_first_audio": tokens_at_first_audio, "round_trips": sum(calls.values()) - before,
            "timeline": [(round(t - start, 4), event, n) for t, event, n in TIMELINE]}


async def run(args) -> dict:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_omni import AsyncOmni
    from vllm_omni.catalog.tiny import build_tiny

    path = build_tiny("qwen3-omni", **(MID if args.size == "mid" else {}))
    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Hello! How are you today?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = {"prompt_token_ids": tok(text).input_ids}
    lengths = list(zip(args.thinker_tokens, args.talker_tokens, strict=True))
    params = {n: [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=frames), None] for n, frames in lengths}
    omni = AsyncOmni(str(path) if args.size == "mid" else "tiny/qwen3-omni", dtype="float32",
                     gpu_memory_utilization=0.15, max_model_len=512, enforce_eager=True, seed=0,
                     skip_mm_profiling=True)
    edge = omni.engine.orchestrator.graph.stages[1].stream_inputs[0]
    calls = count_requests(omni)
    runs: dict[str, list[dict]] = {f"{n} tokens, growth {g}": [] for n in params for g in args.growth}
    try:
        await one_request(omni, prompt, "warm", params[lengths[0][0]], calls)
        for repeat in range(args.repeats):
            for n in params:
                for growth in args.growth if repeat % 2 == 0 else args.growth[::-1]:  # A/B, B/A: no order effect
                    edge.idle_chunk_growth = growth
                    row = await one_request(omni, prompt, f"n{n}-g{growth}-r{repeat}", params[n], calls)
                    runs[f"{n} tokens, growth {growth}"].append(row)
                    print(f"{n} tokens, growth {growth}, repeat {repeat}: "
                          + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in row.items() if k != "timeline"), flush=True)
    finally:
        omni.close()
    medians = {key: {k: float(np.median([r[k] for r in rows])) for k in rows[0] if k != "timeline"}
               for key, rows in runs.items()}
    for key, m in medians.items():
        print(f"{key}: median " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()))
    return {"args": vars(args), "load_avg": os.getloadavg(), "runs": runs, "medians": medians}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["tiny", "mid"], default="tiny",
                        help="mid: bench_stream_cpu.py's wider, deeper thinker (slower than the talker, as in the "
                             "real model)")
    parser.add_argument("--thinker-tokens", type=int, nargs="+", default=[32], help="reply lengths, in turn")
    parser.add_argument("--talker-tokens", type=int, nargs="+", default=[100], help="talker frames, one per length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--growth", type=float, nargs="+", default=[0.0, 1.0],
                        help="idle_chunk_growth values, run in turn each repeat (0: hand on at once, the former rule)")
    parser.add_argument("--json", type=Path, help="write the runs and medians here")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
