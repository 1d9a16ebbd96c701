"""Qwen3-TTS streamed vs store-and-forward decoding on CPU, through `AsyncOmni` (the talker on a real EngineCore).

One run starts a "mid" tiny checkpoint (a wider, deeper talker and decoder than `tiny/qwen3-tts`, so neither
stage is negligible) twice, side by side: with the streamed pipeline (the speech decoder decodes each chunk as the
talker makes its frames) and store-and-forward (the decoder runs once the talker finished; the same chunks). At
concurrency 1 / 4 / 8 (each level streamed, then store-and-forward, under the same load) it measures per request
the time to the first audio chunk (TTFA), end-to-end latency (E2E) and the real-time factor (E2E / audio
seconds), and checks that both modes give the same waveform (greedy, a fixed number of frames). It prints a
table, writes benchmarks/results/bench_tts_stream_cpu-<UTC>.json and a PNG of TTFA and E2E per mode. The decoder
runs in this process with the torch threads the pipeline resolves (`--torch-num-threads` unset: the CPUs the
talker's vLLM worker leaves, 1 on 2 cores), or `--torch-num-threads N`.

    .venv/bin/python benchmarks/qwen3_tts/bench_stream_cpu.py --frames 32 --concurrency 1 4 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
MID = {"hidden": 128, "layers": 4, "text_hidden": 128, "predictor_hidden": 64, "decoder_width": 128}
TEXTS = ["Hello! How are you today? I am fine, thank you. What can I do for you?",
         "Once upon a time there was a small robot that loved to paint mountains and oceans.",
         "The quick brown fox jumps over the lazy dog near the river bank.",
         "vllm-omni serves text, audio, images and video from one engine."]
VOICES = ["vivian", "ryan", "dylan", "vivian"]
RESULTS = Path(__file__).resolve().parents[1] / "results"


async def one_request(omni, prompt: dict, request_id: str, params: list) -> dict:
    start = time.perf_counter()
    ttfa, chunks, audio = None, 0, None
    async for out in omni.generate(prompt, request_id, params):
        if out.final_output_type == "audio":
            ttfa = ttfa if ttfa is not None else time.perf_counter() - start
            chunks += 1
            if out.finished:
                audio = out.multimodal_output["audio"]
    e2e = time.perf_counter() - start
    seconds = len(audio) / 24000
    return {"ttfa_s": ttfa, "e2e_s": e2e, "audio_s": seconds, "rtf": e2e / seconds, "chunks": chunks,
            "audio": audio}


async def run(model: str, args, out: Path) -> dict:
    from vllm import SamplingParams

    from vllm_omni import AsyncOmni
    from vllm_omni.models.qwen3_tts.pipeline import qwen3_tts_pipeline

    # ignore_eos: every request makes `frames` frames (random weights may stop at any time otherwise).
    params = [SamplingParams(temperature=0.0, max_tokens=args.frames + 1, ignore_eos=True), None]
    prompts = [{"prompt": t, "voice": v} for t, v in zip(TEXTS, VOICES, strict=True)]
    threads = {} if args.torch_num_threads is None else {"torch_num_threads": args.torch_num_threads}
    engines = {mode: AsyncOmni(model, pipeline_config=qwen3_tts_pipeline(stream=mode == "streamed"),
                               dtype="float32", gpu_memory_utilization=0.15, max_model_len=1024, enforce_eager=True,
                               seed=0, **threads) for mode in ("streamed", "stored")}
    # The decoder's torch threads as the pipeline resolved them (--torch-num-threads unset: the engine process's
    # share of the CPUs the talker's vLLM worker leaves).
    threads = engines["streamed"].engine.stage_clients[1].config.torch_num_threads
    print(f"decoder torch threads {threads}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)
    rows = {}
    try:
        for mode, omni in engines.items():
            await one_request(omni, prompts[0], f"warm-{mode}", params)
        for concurrency in args.concurrency:
            level = {}
            for mode, omni in engines.items():
                batch = [prompts[i % len(prompts)] for i in range(concurrency)]
                level[mode] = await asyncio.gather(*(one_request(omni, p, f"{mode}-{concurrency}-{i}", params)
                                                     for i, p in enumerate(batch)))
            rows[concurrency] = summarize(level["streamed"], level["stored"])
            report(rows)
            out.write_text(json.dumps({"args": vars(args), "model": MID, "platform": platform.platform(),
                                       "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                                       "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                                       "decoder_torch_threads": threads, "rows": rows}, indent=2))
    finally:
        for omni in engines.values():
            omni.close()
    return rows


def summarize(streamed: list[dict], stored: list[dict]) -> dict:
    def mean(results: list[dict], key: str) -> float:
        return float(np.mean([r[key] for r in results]))

    same = all(np.allclose(a["audio"], b["audio"], atol=1e-5, rtol=1e-5) for a, b in zip(streamed, stored, strict=True))
    return {"streamed_ttfa_s": mean(streamed, "ttfa_s"), "streamed_e2e_s": mean(streamed, "e2e_s"),
            "stored_e2e_s": mean(stored, "e2e_s"), "streamed_rtf": mean(streamed, "rtf"),
            "stored_rtf": mean(stored, "rtf"), "audio_s": mean(streamed, "audio_s"),
            "ttfa_over_stored_e2e": mean(streamed, "ttfa_s") / mean(stored, "e2e_s"),
            "streamed_chunks": mean(streamed, "chunks"), "same_audio": same}


def report(rows: dict) -> None:
    print(f"{'conc':>4} {'TTFA str':>9} {'E2E str':>8} {'E2E s&f':>8} {'TTFA/E2E':>9} {'RTF str':>8} {'RTF s&f':>8} "
          "same", flush=True)
    for c, r in rows.items():
        print(f"{c:>4} {r['streamed_ttfa_s']:9.2f} {r['streamed_e2e_s']:8.2f} {r['stored_e2e_s']:8.2f} "
              f"{r['ttfa_over_stored_e2e']:9.3f} {r['streamed_rtf']:8.2f} {r['stored_rtf']:8.2f} {r['same_audio']}",
              flush=True)


def plot(rows: dict, path: Path) -> None:
    """Grouped bars (mean seconds per request) drawn with PIL: TTFA streamed, E2E per mode, per concurrency."""
    from PIL import Image, ImageDraw

    series = [("streamed TTFA", "streamed_ttfa_s", (31, 119, 180)), ("streamed E2E", "streamed_e2e_s", (214, 39, 40)),
              ("s&f E2E (= its TTFA)", "stored_e2e_s", (255, 152, 150))]
    width, height, left, bottom, top = 760, 420, 60, 50, 60
    top_value = max(r[key] for r in rows.values() for _, key, _ in series) or 1.0
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text((left, 10), "Qwen3-TTS mid tiny, CPU: streamed vs store-and-forward (s per request, mean)",
              fill="black")
    for i, (label, _, color) in enumerate(series):
        draw.rectangle([left + i * 200, 30, left + i * 200 + 12, 42], fill=color)
        draw.text((left + i * 200 + 16, 30), label, fill="black")
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
            draw.text((bx, height - bottom - h - 12), f"{row[key]:.2f}", fill="black")
        draw.text((x0, height - bottom + 8), f"concurrency {concurrency}", fill="black")
    img.save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=32, help="codec frames per request (12.5 per audio second)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--size", choices=["mid", "tiny"], default="mid", help="tiny: tiny/qwen3-tts (smoke run)")
    parser.add_argument("--torch-num-threads", type=int, default=None,
                        help="the decoder's torch threads (--torch-num-threads); unset: as the pipeline resolves them")
    args = parser.parse_args()

    from vllm_omni.catalog.tiny import build_tiny

    path = build_tiny("qwen3-tts", **(MID if args.size == "mid" else {}))
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"bench_tts_stream_cpu-{stamp}.json"
    rows = asyncio.run(run(str(path), args, out))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
