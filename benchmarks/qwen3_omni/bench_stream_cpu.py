"""Qwen3-Omni streamed vs store-and-forward stage hand-off on CPU, through `AsyncOmni` (real EngineCores).

One run starts the same "mid" tiny checkpoint twice, side by side (wider, deeper thinker than `tiny/qwen3-omni`,
so no stage is negligible): with the streamed pipeline (talker starts after the thinker's first tokens, code2wav
decodes each chunk as the talker makes it) and with every edge store-and-forward. At concurrency 1 / 4 / 8 (each
level streamed, then store-and-forward, so both see the same machine load) it measures per
request the time to the first audio chunk (TTFA), end-to-end latency (E2E) and the real-time factor (E2E / audio
seconds), checks that both modes give the same waveform (greedy); with `--repeats N` each level runs N times
(alternating the modes) and the table shows the median of the N runs' means. It writes
benchmarks/results/bench_stream_cpu-<UTC>.json (after every level) and a PNG of TTFA and E2E per mode.

    .venv/bin/python benchmarks/qwen3_omni/bench_stream_cpu.py --concurrency 1 4 8 --repeats 3

Both engines use the same placement: on a CPU-only host the pipeline's default, thinker and talker EngineCores on
disjoint cores (2 cores: thinker core 0, talker core 1; docs/multi_stage.md "CPU placement of AR stages");
`VLLM_CPU_OMP_THREADS_BIND=auto` in the environment measures vLLM's own placement instead (both workers on core 0),
the "before" of that change. The JSON records which (`placement`).

The pipeline's defaults are measured (qwen3_omni_pipeline(): the talker starts after 4 thinker tokens, vocoder
chunks of 4, 8, 16, then 32 codec frames); --first-chunk / --chunk-tokens / --vocoder-chunks try others.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
MID = {"thinker_hidden": 512, "thinker_layers": 8}
PROMPTS = ["Hello! How are you today?", "Describe the image in detail, then answer the question.",
           "Once upon a time there was a small robot.", "What can I do for you?"]
RESULTS = Path(__file__).resolve().parents[1] / "results"


async def one_request(omni, prompt: dict, request_id: str, params: list) -> dict:
    start = time.perf_counter()
    ttfa, chunks = None, []
    async for out in omni.generate(prompt, request_id, params):
        if out.stage_id == 2:
            ttfa = ttfa if ttfa is not None else time.perf_counter() - start
            chunks.append(out.multimodal_output["audio_chunk"])
            if out.finished:
                audio = out.multimodal_output["audio"]
    e2e = time.perf_counter() - start
    seconds = len(audio) / 24000
    return {"ttfa_s": ttfa, "e2e_s": e2e, "audio_s": seconds, "rtf": e2e / seconds, "chunks": len(chunks),
            "audio": audio}


def start(model: str, stream: bool, args):
    from vllm_omni import AsyncOmni
    from vllm_omni.models.qwen3_omni.pipeline import qwen3_omni_pipeline

    schedule = {k: v for k, v in (("first_chunk_tokens", args.first_chunk), ("chunk_tokens", args.chunk_tokens),
                                  ("vocoder_chunks", args.vocoder_chunks and tuple(args.vocoder_chunks))) if v}
    return AsyncOmni(model, pipeline_config=qwen3_omni_pipeline(stream=stream, **schedule), dtype="float32",
                     gpu_memory_utilization=0.15, max_model_len=512, enforce_eager=True, seed=0)


async def run_level(omni, tag: str, concurrency: int, params: list, prompts: list[dict]) -> dict:
    batch = [prompts[i % len(prompts)] for i in range(concurrency)]
    begin = time.perf_counter()
    results = await asyncio.gather(*(one_request(omni, p, f"{tag}-{concurrency}-{i}", params)
                                     for i, p in enumerate(batch)))
    return {"wall_s": time.perf_counter() - begin, "requests": results}


async def run(model: str, args, prompts: list[dict], out: Path) -> dict:
    """Both engines up at once; each concurrency level runs streamed then store-and-forward (same load), and
    the results so far are written after each level."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=args.thinker_tokens, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=args.talker_tokens), None]
    engines = {"streamed": start(model, True, args), "stored": start(model, False, args)}
    levels: dict[str, dict] = {"streamed": {}, "stored": {}}
    try:
        for tag, omni in engines.items():
            await one_request(omni, prompts[0], f"warm-{tag}", params)
        for concurrency in args.concurrency:
            for repeat in range(args.repeats):
                for tag, omni in engines.items():
                    run = await run_level(omni, f"{tag}-r{repeat}", concurrency, params, prompts)
                    levels[tag].setdefault(concurrency, []).append(run)
            rows = summarize(levels["streamed"], levels["stored"])
            report(rows)
            out.write_text(json.dumps({"args": vars(args), "model": args.model_info, "placement": placement(),
                                       "platform": platform.platform(),
                                       "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "rows": rows}, indent=2))
    finally:
        for omni in engines.values():
            omni.close()
    return rows


def placement() -> str:
    """Where the AR workers' OpenMP threads run (the resolution's rule for two AR EngineCores)."""
    from vllm_omni.config.deploy_config import split_cpus

    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    return f"VLLM_CPU_OMP_THREADS_BIND={bind}" if bind else f"thinker, talker cpu_threads_bind {split_cpus(2)}"


def run_mean(run: dict, key: str) -> float:
    return float(np.mean([r[key] for r in run["requests"]]))


def _median(runs: list[tuple[dict, dict]], side: int, key: str) -> float:
    """Median over the repeats of one mode's (0: streamed, 1: store-and-forward) run means."""
    return float(np.median([run_mean(pair[side], key) for pair in runs]))


def summarize(streamed: dict, stored: dict) -> dict:
    """Per concurrency: the median over repeats of each run's mean per request."""
    rows = {}
    for c in streamed:
        runs = list(zip(streamed[c], stored[c], strict=True))
        same = all(np.allclose(a["audio"], b["audio"], atol=1e-5, rtol=1e-5)
                   for s_run, n_run in runs for a, b in zip(s_run["requests"], n_run["requests"], strict=True))
        median = functools.partial(_median, runs)
        ttfa_ratios = [run_mean(a, "ttfa_s") / run_mean(b, "e2e_s") for a, b in runs]
        e2e_ratios = [run_mean(a, "e2e_s") / run_mean(b, "e2e_s") for a, b in runs]
        rows[c] = {"streamed_ttfa_s": median(0, "ttfa_s"), "streamed_e2e_s": median(0, "e2e_s"),
                   "stored_ttfa_s": median(1, "ttfa_s"), "stored_e2e_s": median(1, "e2e_s"),
                   "streamed_rtf": median(0, "rtf"), "stored_rtf": median(1, "rtf"), "audio_s": median(0, "audio_s"),
                   # ratios within one run (both modes back to back, same load), median over the repeats
                   "ttfa_over_stored_e2e": float(np.median(ttfa_ratios)), "e2e_ratio": float(np.median(e2e_ratios)),
                   "same_audio": same, "streamed_chunks": median(0, "chunks"), "repeats": len(runs),
                   "runs_ttfa_over_stored_e2e": ttfa_ratios, "runs_e2e_ratio": e2e_ratios}
    return rows


def plot(rows: dict, path: Path) -> None:
    """Grouped bars (mean seconds per request) drawn with PIL: TTFA and E2E per mode, per concurrency."""
    from PIL import Image, ImageDraw

    series = [("streamed TTFA", "streamed_ttfa_s", (31, 119, 180)), ("s&f TTFA", "stored_ttfa_s", (174, 199, 232)),
              ("streamed E2E", "streamed_e2e_s", (214, 39, 40)), ("s&f E2E", "stored_e2e_s", (255, 152, 150))]
    width, height, left, bottom, top = 760, 420, 60, 50, 60
    top_value = max(r[key] for r in rows.values() for _, key, _ in series) or 1.0
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text((left, 10), "Qwen3-Omni mid tiny, CPU: streamed vs store-and-forward (s per request, median of runs' "
                          "means)", fill="black")
    for i, (label, _, color) in enumerate(series):
        draw.rectangle([left + i * 170, 30, left + i * 170 + 12, 42], fill=color)
        draw.text((left + i * 170 + 16, 30), label, fill="black")
    plot_h = height - bottom - top
    draw.line([left, height - bottom, width - 20, height - bottom], fill="black")
    group_w = (width - left - 20) / len(rows)
    for g, (concurrency, row) in enumerate(rows.items()):
        x0 = left + g * group_w + 20
        for i, (_, key, color) in enumerate(series):
            h = row[key] / top_value * plot_h
            bx = x0 + i * (group_w - 40) / len(series)
            draw.rectangle([bx, height - bottom - h, bx + (group_w - 40) / len(series) - 4, height - bottom],
                           fill=color)
            draw.text((bx, height - bottom - h - 12), f"{row[key]:.1f}", fill="black")
        draw.text((x0, height - bottom + 8), f"concurrency {concurrency}", fill="black")
    img.save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--thinker-tokens", type=int, default=128)
    parser.add_argument("--talker-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--size", choices=["mid", "tiny"], default="mid", help="tiny: tiny/qwen3-omni (smoke run)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per concurrency level (the table: medians)")
    parser.add_argument("--first-chunk", type=int, help="thinker tokens before the talker starts")
    parser.add_argument("--chunk-tokens", type=int, help="thinker tokens per later hand-off")
    parser.add_argument("--vocoder-chunks", type=int, nargs="+", help="codec frames per vocoder chunk, in order")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from vllm_omni.catalog.tiny import build_tiny

    path = build_tiny("qwen3-omni", **(MID if args.size == "mid" else {}))
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [{"prompt_token_ids": tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False)}
        for text in PROMPTS]
    args.model_info = MID if args.size == "mid" else "tiny/qwen3-omni"
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"bench_stream_cpu-{stamp}.json"
    rows = asyncio.run(run(str(path), args, prompts, out))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def report(rows: dict) -> None:
    print(f"{'conc':>4} {'TTFA str':>9} {'E2E str':>8} {'E2E s&f':>8} {'TTFA/E2E':>9} {'E2E ratio':>9} "
          f"{'RTF str':>8} {'RTF s&f':>8} same", flush=True)
    for c, r in rows.items():
        print(f"{c:>4} {r['streamed_ttfa_s']:9.2f} {r['streamed_e2e_s']:8.2f} {r['stored_e2e_s']:8.2f} "
              f"{r['ttfa_over_stored_e2e']:9.3f} {r['e2e_ratio']:9.3f} {r['streamed_rtf']:8.2f} "
              f"{r['stored_rtf']:8.2f} {r['same_audio']}", flush=True)


if __name__ == "__main__":
    main()
