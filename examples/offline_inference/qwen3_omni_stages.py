"""Qwen3-Omni text -> text + speech, stage by stage: vLLM's thinker, our talker, our streaming Code2Wav.

Runs on CPU with the tiny checkpoint (random weights: the "speech" is noise, the point is the plumbing):

    .venv/bin/python examples/offline_inference/qwen3_omni_stages.py --out /tmp/omni.wav

With a real checkpoint: `--model Qwen/Qwen3-Omni-30B-A3B-Instruct` (GPU; the talker and vocoder then run on
the same device as this process).
"""

from __future__ import annotations

import argparse
import os
import wave

import numpy as np

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny/qwen3-omni")
    parser.add_argument("--prompt", default="Hello! How are you today?")
    parser.add_argument("--speaker", default="ethan")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-codec-tokens", type=int, default=32)
    parser.add_argument("--out", default="qwen3_omni.wav")
    args = parser.parse_args()

    import torch
    from transformers import AutoConfig, AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_omni.catalog.tiny import resolve_model
    from vllm_omni.models.qwen3_omni.code2wav import Qwen3OmniCode2Wav
    from vllm_omni.models.qwen3_omni.stage_input_processors import (
        Qwen3OmniTokenIds,
        talker_to_code2wav,
        thinker_to_talker,
    )
    from vllm_omni.models.qwen3_omni.talker import Qwen3OmniTalker, TalkerSamplingParams

    model = resolve_model(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": args.prompt}]
    prompt_ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)).input_ids

    # Stage 0: the thinker, vLLM's own Qwen3OmniMoeThinkerForConditionalGeneration.
    llm = LLM(model=model, max_model_len=4096, gpu_memory_utilization=0.15 if device == "cpu" else 0.5,
              limit_mm_per_prompt={"image": 0, "video": 0, "audio": 0})
    out = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    text_ids = list(out[0].outputs[0].token_ids)
    print("text:", out[0].outputs[0].text)

    # Stage 1: the talker, conditioned on the thinker's tokens; frames stream out one by one.
    token_ids = Qwen3OmniTokenIds.from_config(AutoConfig.from_pretrained(model))
    talker = Qwen3OmniTalker.from_pretrained(model, device=device)
    code2wav = Qwen3OmniCode2Wav.from_pretrained(model, device=device)
    talker_prompt = thinker_to_talker(prompt_ids, text_ids, token_ids, speaker=args.speaker)

    # Stage 2: Code2Wav on chunks of 25 frames (2 s of audio) with 10 frames of left context.
    frames, audio, done = [], [], 0
    for frame in talker.iter_frames(talker_prompt, TalkerSamplingParams(max_new_tokens=args.max_codec_tokens)):
        frames.append(frame)
        chunks = talker_to_code2wav(frames, chunk_size=25, left_context=10, start_frame=done, final=False)
        for chunk, wav in zip(chunks, code2wav(chunks), strict=True):
            print(f"audio packet {chunk.index}: {len(wav) / code2wav.sample_rate:.2f}s")
            audio.append(wav)
            done += len(chunk.codes[0]) - chunk.context
    audio += code2wav(talker_to_code2wav(frames, chunk_size=25, left_context=10, start_frame=done, final=True))

    pcm = (np.clip(np.concatenate(audio), -1, 1) * 32767).astype(np.int16)
    with wave.open(args.out, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(code2wav.sample_rate)
        f.writeframes(pcm.tobytes())
    print(f"wrote {args.out}: {len(pcm) / code2wav.sample_rate:.2f}s, {len(frames)} codec frames")


if __name__ == "__main__":
    main()
