"""Qwen3-Omni through `Omni`: the thinker's text answer and its speech (thinker -> talker -> code2wav).

    .venv/bin/python examples/offline_inference/qwen3_omni.py --out reply.wav          # tiny checkpoint, CPU
"""

from __future__ import annotations

import argparse
import wave

import numpy as np
from transformers import AutoTokenizer
from vllm import SamplingParams

from vllm_omni import Omni
from vllm_omni.catalog.tiny import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny/qwen3-omni")
    parser.add_argument("--prompt", default="Hello! How are you today?")
    parser.add_argument("--voice", default="ethan")
    parser.add_argument("--max-tokens", type=int, default=16, help="thinker (text) tokens")
    parser.add_argument("--max-frames", type=int, default=64, help="talker codec frames (12.5 per second)")
    parser.add_argument("--out", default="reply.wav")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                         add_generation_prompt=True)
    omni = Omni(args.model, dtype="float32", gpu_memory_utilization=0.15, max_model_len=512)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                  SamplingParams(max_tokens=args.max_frames), None]
        answer, speech = omni.generate({"prompt": text, "voice": args.voice}, params)
    finally:
        omni.close()
    audio = speech.multimodal_output["audio"]
    with wave.open(args.out, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(speech.multimodal_output["sample_rate"])
        f.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    print(f"text: {answer.text!r}")
    print(f"audio: {len(audio) / speech.multimodal_output['sample_rate']:.2f} s -> {args.out}; "
          f"stage durations: { {k: round(v, 3) for k, v in speech.stage_durations.items()} }")


if __name__ == "__main__":
    main()
