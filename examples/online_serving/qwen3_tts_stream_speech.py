"""Stream speech from `vllm serve ... --omni` on Qwen3-TTS into a file: `/v1/audio/speech` with
`with_streaming_response` writes the WAV's bytes as the server makes them (the first audio comes while the talker
is still reading the text) and prints when the first bytes came.

    vllm serve tiny/qwen3-tts --omni --gpu-memory-utilization 0.15 --max-model-len 128 --dtype float32 &
    .venv/bin/python examples/online_serving/qwen3_tts_stream_speech.py --voice vivian --out speech.wav

A VoiceDesign checkpoint (`tiny/qwen3-tts-voice-design`, `Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign`) takes the voice
from `--instructions` ("a calm, low male voice") instead of `--voice`.
"""

from __future__ import annotations

import argparse
import time

import server_args


def main() -> None:
    parser = argparse.ArgumentParser()
    server_args.add_server_args(parser)
    parser.add_argument("--text", default="Once upon a time there was a small robot that loved to paint mountains.")
    parser.add_argument("--voice", default=None, help="a CustomVoice speaker (tiny: vivian, ryan, dylan), or an "
                                                      "OpenAI voice name (the model's first speaker)")
    parser.add_argument("--instructions", default=None, help="VoiceDesign: the voice; 1.7B CustomVoice: the style")
    parser.add_argument("--seed", type=int, default=None, help="the talker's sampling seed (same seed, same audio)")
    parser.add_argument("--out", default="speech.wav")
    args = parser.parse_args()
    client = server_args.client(args)
    model = client.models.list().data[0].id
    extra = {"seed": args.seed} if args.seed is not None else {}
    voice = {"instructions": args.instructions} if args.instructions else {}
    start, first, size = time.perf_counter(), None, 0
    with client.audio.speech.with_streaming_response.create(
            model=model, input=args.text, voice=args.voice or "alloy", response_format="wav", extra_body=extra,
            **voice) as response, open(args.out, "wb") as out:
        for data in response.iter_bytes():
            first = first or time.perf_counter() - start
            size += len(data)
            out.write(data)
    print(f"first bytes after {first:.2f} s, all after {time.perf_counter() - start:.2f} s; "
          f"saved {args.out} ({size} bytes)")


if __name__ == "__main__":
    main()
