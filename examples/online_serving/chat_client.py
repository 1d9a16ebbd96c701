"""Chat with `vllm serve MODEL --omni`: text (streamed or not), images from diffusion models, audio when the
pipeline produces it.

    vllm serve tiny/qwen2 --omni --gpu-memory-utilization 0.15 --max-model-len 512 &
    .venv/bin/python examples/online_serving/chat_client.py --stream
    vllm serve tiny/qwen3-omni --omni --gpu-memory-utilization 0.15 --max-model-len 512 --dtype float32 &
    .venv/bin/python examples/online_serving/chat_client.py --audio --voice ethan --max-tokens 16   # reply.wav
    vllm serve tiny/qwen-image --omni &
    .venv/bin/python examples/online_serving/chat_client.py --prompt "a red cube" --size 64x64
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

import server_args


def main() -> None:
    parser = argparse.ArgumentParser()
    server_args.add_server_args(parser)
    parser.add_argument("--prompt", default="Tell me about lighthouses.")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--audio", action="store_true", help="ask for text + audio (omni models)")
    parser.add_argument("--voice", help="speaker for --audio (Qwen3-Omni: ethan, chelsie, aiden)")
    parser.add_argument("--size", help="image size for diffusion models, e.g. 64x64")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    client = server_args.client(args)
    model = client.models.list().data[0].id
    kwargs: dict = {"model": model, "messages": [{"role": "user", "content": args.prompt}],
                    "max_tokens": args.max_tokens}
    if args.audio:
        audio = {"format": "wav"} | ({"voice": args.voice} if args.voice else {})
        kwargs |= {"modalities": ["text", "audio"], "audio": audio}
    if args.size:
        kwargs["extra_body"] = {"size": args.size, "num_inference_steps": args.steps, "seed": 0}

    if args.stream:
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None and isinstance(delta.content, str):
                print(delta.content, end="", flush=True)
        print()
        return
    message = client.chat.completions.create(**kwargs).choices[0].message
    if isinstance(message.content, list):  # image parts from a diffusion stage
        for i, part in enumerate(message.content):
            if part.get("type") == "image_url":
                data = part["image_url"]["url"].split(",", 1)[1]
                Path(f"chat-{i}.png").write_bytes(base64.b64decode(data))
                print(f"wrote chat-{i}.png")
    else:
        print(message.content)
    if message.audio is not None:
        Path("reply.wav").write_bytes(base64.b64decode(message.audio.data))
        print("wrote reply.wav")


if __name__ == "__main__":
    main()
