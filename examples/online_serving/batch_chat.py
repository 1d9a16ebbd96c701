"""Send several conversations in one request to `/v1/chat/completions/batch` (raw HTTP: not in the openai client).

    vllm serve tiny/qwen2 --omni --gpu-memory-utilization 0.15 --max-model-len 512 &
    .venv/bin/python examples/online_serving/batch_chat.py "hello" "what is a lighthouse?"
"""

from __future__ import annotations

import argparse

import httpx
import server_args


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("prompts", nargs="+")
    server_args.add_server_args(parser)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    body = {"messages": [[{"role": "user", "content": p}] for p in args.prompts], "max_tokens": args.max_tokens}
    resp = httpx.post(f"{server_args.server_url(args)}/v1/chat/completions/batch", json=body, timeout=600,
                      headers={"X-Request-Id": "example", **server_args.auth_headers(args)})
    resp.raise_for_status()
    data = resp.json()
    print(f"{data['id']}: {data['usage']}")
    for choice in data["choices"]:
        print(f"[{choice['index']}] {choice['message']['content']!r}")


if __name__ == "__main__":
    main()
