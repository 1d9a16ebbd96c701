"""Streamed spoken reply from `vllm serve ... --omni` on Qwen3-Omni: chat with stream=True and modalities
["text", "audio"] prints the text as it comes and writes the audio chunks (raw 24 kHz PCM16) as they arrive,
then saves them as reply.wav; `--speech` streams `/v1/audio/speech` into speech.wav instead.

    vllm serve tiny/qwen3-omni --omni --gpu-memory-utilization 0.15 --max-model-len 512 --dtype float32 &
    .venv/bin/python examples/online_serving/qwen3_omni_stream_audio.py --max-tokens 64
    .venv/bin/python examples/online_serving/qwen3_omni_stream_audio.py --speech
"""

from __future__ import annotations

import argparse
import base64
import time
import wave

import server_args


def chat(client, model: str, args) -> None:
    start, first_audio, pcm, transcript = time.perf_counter(), None, bytearray(), []
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens, stream=True,
        modalities=["text", "audio"], audio={"voice": args.voice, "format": "pcm16"})
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        if delta.content:
            print(delta.content, end="", flush=True)
        if delta.audio is not None:
            audio = delta.audio if isinstance(delta.audio, dict) else delta.audio.model_dump()
            if audio.get("data"):
                first_audio = first_audio or time.perf_counter() - start
                pcm += base64.b64decode(audio["data"])
            transcript.append(audio.get("transcript") or "")
    print(f"\nfirst audio after {first_audio:.2f} s, {len(pcm) / 48000:.2f} s of audio")
    with wave.open(args.out or "reply.wav", "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(24000)
        f.writeframes(bytes(pcm))
    print(f"saved {args.out or 'reply.wav'}; transcript: {''.join(transcript)!r}")


def speech(client, model: str, args) -> None:
    start, first, size = time.perf_counter(), None, 0
    path = args.out or "speech.wav"
    with client.audio.speech.with_streaming_response.create(
            model=model, voice=args.voice, input=args.prompt, response_format="wav",
            extra_body={} if args.seed is None else {"seed": args.seed}) as response, \
            open(path, "wb") as out:
        for data in response.iter_bytes():
            first = first or time.perf_counter() - start
            size += len(data)
            out.write(data)
    print(f"first bytes after {first:.2f} s; saved {path} ({size} bytes, a WAV stream)")


def main() -> None:
    parser = argparse.ArgumentParser()
    server_args.add_server_args(parser)
    parser.add_argument("--prompt", default="Tell me about lighthouses.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--voice", default="ethan", help="Qwen3-Omni: ethan, chelsie, aiden")
    parser.add_argument("--seed", type=int, default=None, help="--speech: the sampling seed (same seed, same audio)")
    parser.add_argument("--speech", action="store_true", help="stream /v1/audio/speech instead of chat")
    parser.add_argument("--out", help="output WAV (default reply.wav / speech.wav)")
    args = parser.parse_args()
    client = server_args.client(args)
    model = client.models.list().data[0].id
    (speech if args.speech else chat)(client, model, args)


if __name__ == "__main__":
    main()
