"""Qwen3-Omni through `Omni` with media input: a WAV (or a generated tone) and an image (or a generated one) go to
vLLM's thinker as `multi_modal_data`; the answer is text, and with `--speech-out` also speech (the talker is
conditioned on the thinker's hidden states at the media positions).

    .venv/bin/python examples/offline_inference/qwen3_omni_media.py                         # tiny checkpoint, CPU
    .venv/bin/python examples/offline_inference/qwen3_omni_media.py --wav q.wav --image photo.jpg --out answer.txt
    .venv/bin/python examples/offline_inference/qwen3_omni_media.py --speech-out answer.wav
"""

from __future__ import annotations

import argparse
import wave
from pathlib import Path

import av
import numpy as np
from PIL import Image
from vllm import SamplingParams

from vllm_omni import Omni

SAMPLE_RATE = 16000  # what Qwen3-Omni's audio encoder takes


def load_audio(path: str | None) -> np.ndarray:
    """Mono float32 at 16 kHz, decoded and resampled with PyAV; a 1 s 440 Hz tone without a file."""
    if path is None:
        return (0.3 * np.sin(2 * np.pi * 440 * np.arange(SAMPLE_RATE) / SAMPLE_RATE)).astype(np.float32)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    with av.open(path) as container:
        chunks = [frame.to_ndarray().reshape(-1) for decoded in container.decode(audio=0)
                  for frame in resampler.resample(decoded)]
    return np.concatenate(chunks).astype(np.float32)


def save_wav(path: str, samples: np.ndarray, rate: int) -> None:
    with wave.open(path, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny/qwen3-omni")
    parser.add_argument("--wav", help="audio file (any format PyAV decodes)")
    parser.add_argument("--image", help="image file")
    parser.add_argument("--question", default="What do you hear and see?")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default="answer.txt")
    parser.add_argument("--speech-out", help="also speak the answer and save it here (16-bit WAV)")
    args = parser.parse_args()

    audio = load_audio(args.wav)
    image = Image.open(args.image).convert("RGB") if args.image else Image.new("RGB", (64, 64), (200, 40, 40))
    omni = Omni(args.model, dtype="float32", gpu_memory_utilization=0.15, max_model_len=2048)
    try:
        messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "image"},
                                                 {"type": "text", "text": args.question}]}]
        prompt = omni.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        request = {"prompt": prompt, "multi_modal_data": {"audio": (audio, SAMPLE_RATE), "image": image}}
        params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens), None, None]
        modalities = ["text", "audio"] if args.speech_out else ["text"]
        answer, *speech = omni.generate(request, params, output_modalities=modalities)
    finally:
        omni.close()
    if speech:
        save_wav(args.speech_out, speech[0].multimodal_output["audio"], speech[0].multimodal_output["sample_rate"])
        print(f"speech -> {args.speech_out}")
    Path(args.out).write_text(answer.text)
    print(f"text: {answer.text!r} -> {args.out}; prompt tokens (media expanded): "
          f"{len(answer.request_output.prompt_token_ids)}")


if __name__ == "__main__":
    main()
