"""Send a WAV and an image to `vllm serve tiny/qwen3-omni --omni` as chat content parts (`input_audio`,
`image_url` data URL) and save the reply. Without files it makes a 1 s tone and a small image itself.

    vllm serve tiny/qwen3-omni --omni --gpu-memory-utilization 0.15 --max-model-len 1024 --dtype float32 &
    .venv/bin/python examples/online_serving/qwen3_omni_media_client.py --out reply.txt
    .venv/bin/python examples/online_serving/qwen3_omni_media_client.py --wav question.wav --image photo.png

The reply is text; with `--speech-out reply.wav` also speech (non-streamed here; streamed audio:
qwen3_omni_stream_audio.py).
"""

from __future__ import annotations

import argparse
import base64
import io
import wave
from pathlib import Path

import numpy as np
import server_args
from PIL import Image


def tone_wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    samples = (0.3 * np.sin(2 * np.pi * 440 * np.arange(int(seconds * rate)) / rate) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(samples.tobytes())
    return buf.getvalue()


def png_data_url(path: str | None) -> str:
    image = Image.open(path).convert("RGB") if path else Image.new("RGB", (64, 64), (200, 40, 40))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def main() -> None:
    parser = argparse.ArgumentParser()
    server_args.add_server_args(parser)
    parser.add_argument("--wav", help="a WAV file (default: a generated 1 s tone)")
    parser.add_argument("--image", help="an image file (default: a generated 64x64 image)")
    parser.add_argument("--question", default="What do you hear and see?")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--out", default="reply.txt")
    parser.add_argument("--speech-out", help="also ask for speech and save the WAV here")
    args = parser.parse_args()

    client = server_args.client(args)
    wav = Path(args.wav).read_bytes() if args.wav else tone_wav()
    content = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
               {"type": "image_url", "image_url": {"url": png_data_url(args.image)}},
               {"type": "text", "text": args.question}]
    request = {"model": client.models.list().data[0].id, "messages": [{"role": "user", "content": content}],
               "modalities": ["text"], "max_tokens": args.max_tokens}
    if args.speech_out:
        request.update(modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"})
        message = client.chat.completions.create(**request).choices[0].message
        Path(args.speech_out).write_bytes(base64.b64decode(message.audio.data))
        print(f"speech -> {args.speech_out}")
        reply = message.content or ""
    elif args.stream:
        chunks = client.chat.completions.create(**request, stream=True)
        reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        reply = client.chat.completions.create(**request).choices[0].message.content or ""
    Path(args.out).write_text(reply)
    print(f"reply: {reply!r} -> {args.out}")


if __name__ == "__main__":
    main()
