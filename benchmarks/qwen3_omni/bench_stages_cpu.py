"""Qwen3-Omni thinker -> talker -> code2wav on CPU: our stages vs transformers' `generate`, same tiny weights.

Per request it times transformers' one-shot `generate(return_audio=True)` (reference) and two of our chains, both
starting from vLLM's thinker (all requests in one batch, warm engine):
  streaming: our in-process talker yields frames, Code2Wav decodes small chunks as they arrive (TTFP);
  vllm-talker: our talker on vLLM's EngineCore, all requests in one batch, then Code2Wav per request.
Reports E2E latency, time to first audio packet (TTFP: transformers has no streaming, so its TTFP is its E2E),
real-time factor, and checks tokens / frames / waveforms. Prints a table and writes
benchmarks/results/bench_stages_cpu-<UTC>.json.

    .venv/bin/python benchmarks/qwen3_omni/bench_stages_cpu.py --requests 4 --thinker-tokens 16 --talker-tokens 24
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
PROMPTS = ["Hello! How are you today?", "Describe the image in detail, then answer the question.",
           "Once upon a time there was a small robot.", "What can I do for you?"]


def _prompt_ids(tok, text: str) -> list[int]:
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}]
    return tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)).input_ids


def _reference(hf_model, ids: list[int], args) -> tuple[float, list[int], np.ndarray]:
    start = time.perf_counter()
    with torch.inference_mode():
        seq, wav = hf_model.generate(
            torch.tensor([ids]), thinker_max_new_tokens=args.thinker_tokens, thinker_do_sample=False,
            thinker_eos_token_id=None, talker_do_sample=False, talker_max_new_tokens=args.talker_tokens,
            talker_repetition_penalty=1.0, return_audio=True)
    return time.perf_counter() - start, seq[0, len(ids):].tolist(), wav[0, 0].numpy()


def _ours(talker, code2wav, token_ids, ids: list[int], text_tokens: list[int], args) -> dict:
    from vllm_omni.models.qwen3_omni.stage_input_processors import (
        talker_to_code2wav,
        thinker_to_talker,
    )
    from vllm_omni.models.qwen3_omni.talker import TalkerSamplingParams

    start = time.perf_counter()
    prompt = thinker_to_talker(ids, text_tokens, token_ids)
    frames, audio, ttfp, done = [], [], None, 0
    for frame in talker.iter_frames(prompt, TalkerSamplingParams(max_new_tokens=args.talker_tokens)):
        frames.append(frame)
        chunks = talker_to_code2wav(frames, chunk_size=args.chunk, left_context=args.context, start_frame=done,
                                    final=False)
        if chunks:
            audio += code2wav(chunks)
            done += sum(len(c.codes[0]) - c.context for c in chunks)
            ttfp = ttfp if ttfp is not None else time.perf_counter() - start
    audio += code2wav(talker_to_code2wav(frames, chunk_size=args.chunk, left_context=args.context,
                                         start_frame=done, final=True))
    total = time.perf_counter() - start
    return {"talker_code2wav_s": total, "ttfp_after_thinker_s": ttfp if ttfp is not None else total,
            "frames": frames, "wav": np.concatenate(audio)}


def _stream_diff(hf_model, ours: dict, args) -> float:
    """Our streamed audio vs transformers' `chunked_decode` with the same chunking."""
    with torch.inference_mode():
        ref = hf_model.code2wav.chunked_decode(torch.tensor(ours["frames"]).T[None], chunk_size=args.chunk,
                                               left_context_size=args.context)[0, 0].numpy()
    return float(np.abs(ours["wav"] - ref).max()) if len(ref) == len(ours["wav"]) else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--thinker-tokens", type=int, default=16)
    parser.add_argument("--talker-tokens", type=int, default=24)
    parser.add_argument("--chunk", type=int, default=4, help="code2wav streaming chunk (frames)")
    parser.add_argument("--context", type=int, default=2, help="code2wav left context (frames)")
    args = parser.parse_args()

    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration
    from vllm import LLM, SamplingParams

    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.models.qwen3_omni.code2wav import Qwen3OmniCode2Wav
    from vllm_omni.models.qwen3_omni.stage_input_processors import Qwen3OmniTokenIds
    from vllm_omni.models.qwen3_omni.talker import Qwen3OmniTalker

    path = build_tiny("qwen3-omni")
    tok = AutoTokenizer.from_pretrained(path)
    hf_model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    talker, code2wav = Qwen3OmniTalker.from_pretrained(path), Qwen3OmniCode2Wav.from_pretrained(path)
    token_ids = Qwen3OmniTokenIds.from_config(hf_model.config)
    t0 = time.perf_counter()
    llm = LLM(model=str(path), dtype="float32", gpu_memory_utilization=0.15, max_model_len=512,
              enforce_eager=True, seed=0, limit_mm_per_prompt={"image": 0, "video": 0, "audio": 0})
    vllm_startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.thinker_tokens, ignore_eos=True)
    prompts = [_prompt_ids(tok, PROMPTS[i % len(PROMPTS)]) for i in range(args.requests)]
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up

    t0 = time.perf_counter()
    thinker_out = [list(o.outputs[0].token_ids) for o in
                   llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    thinker_batch_s = time.perf_counter() - t0

    rows = []
    for ids, text_tokens in zip(prompts, thinker_out, strict=True):
        ref_s, ref_tokens, ref_wav = _reference(hf_model, ids, args)
        ours = _ours(talker, code2wav, token_ids, ids, text_tokens, args)
        audio_s = len(ours["wav"]) / code2wav.sample_rate
        rows.append({
            "ref_e2e_s": ref_s,
            "ours_e2e_s": thinker_batch_s / len(prompts) + ours["talker_code2wav_s"],
            "ours_ttfp_s": thinker_batch_s / len(prompts) + ours["ttfp_after_thinker_s"],
            "audio_s": audio_s,
            "ours_rtf": (thinker_batch_s / len(prompts) + ours["talker_code2wav_s"]) / max(audio_s, 1e-9),
            "ref_rtf": ref_s / max(len(ref_wav) / code2wav.sample_rate, 1e-9),
            "tokens_equal": text_tokens == ref_tokens,
            "stream_vs_chunked_decode_max_abs_diff": _stream_diff(hf_model, ours, args),
            "frames": ours["frames"],
        })
    llm.llm_engine.engine_core.shutdown()

    # Our talker on vLLM's EngineCore: all requests in one batch.
    from vllm_omni.models.qwen3_omni.stage_input_processors import talker_to_code2wav, thinker_to_talker
    from vllm_omni.models.qwen3_omni.vllm_talker import talker_engine_kwargs, talker_request

    talker_llm = LLM(model=str(path), dtype="float32", gpu_memory_utilization=0.15, max_model_len=512, seed=0,
                     **talker_engine_kwargs())
    keys = [f"r{i}" for i in range(len(prompts))]
    reqs = [talker_request(thinker_to_talker(p, o, token_ids), k, hf_model.config.talker_config,
                           max_new_tokens=args.talker_tokens)
            for p, o, k in zip(prompts, thinker_out, keys, strict=True)]
    talker_llm.generate([reqs[0][0]], [reqs[0][1]], use_tqdm=False)  # warm-up
    talker_llm.collective_rpc("take_talker_frames", args=(keys[:1],))
    t0 = time.perf_counter()
    talker_llm.generate([r[0] for r in reqs], [r[1] for r in reqs], use_tqdm=False)
    vllm_frames = talker_llm.collective_rpc("take_talker_frames", args=(keys,))[0]
    for key in keys:
        code2wav(talker_to_code2wav(vllm_frames[key]))
    vllm_talker_s = time.perf_counter() - t0
    talker_llm.llm_engine.engine_core.shutdown()
    for row, key in zip(rows, keys, strict=True):
        row["vllm_talker_frames_equal"] = vllm_frames[key] == row.pop("frames")
        row["vllm_talker_e2e_s"] = (thinker_batch_s + vllm_talker_s) / len(prompts)

    mean = {k: float(np.mean([r[k] for r in rows])) for k in ("ref_e2e_s", "ours_e2e_s", "ours_ttfp_s", "audio_s",
                                                              "ours_rtf", "ref_rtf", "vllm_talker_e2e_s")}
    print(f"\nQwen3-Omni tiny, {args.requests} requests, thinker {args.thinker_tokens} tok, talker "
          f"{args.talker_tokens} tok, chunk {args.chunk}+{args.context} (vLLM thinker startup {vllm_startup:.1f}s)")
    print(f"{'metric':<28}{'transformers':>14}{'streaming':>14}{'vllm-talker':>14}")
    print(f"{'E2E per request (s)':<28}{mean['ref_e2e_s']:>14.3f}{mean['ours_e2e_s']:>14.3f}"
          f"{mean['vllm_talker_e2e_s']:>14.3f}")
    print(f"{'TTFP (s)':<28}{mean['ref_e2e_s']:>14.3f}{mean['ours_ttfp_s']:>14.3f}{'-':>14}")
    print(f"{'RTF':<28}{mean['ref_rtf']:>14.3f}{mean['ours_rtf']:>14.3f}{'-':>14}")
    print(f"text tokens equal: {all(r['tokens_equal'] for r in rows)}; vLLM talker frames equal in-process "
          f"talker's: {all(r['vllm_talker_frames_equal'] for r in rows)}; streamed audio vs transformers' "
          f"chunked_decode (same chunking) max |diff|: "
          f"{max(r['stream_vs_chunked_decode_max_abs_diff'] for r in rows):.2e}")

    out = Path(__file__).resolve().parents[1] / "results"
    out.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    result = {"args": vars(args), "rows": rows, "mean": mean, "vllm_startup_s": vllm_startup,
              "thinker_batch_s": thinker_batch_s, "torch": torch.__version__, "machine": platform.machine(),
              "cpus": os.cpu_count()}
    (out / f"bench_stages_cpu-{stamp}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
