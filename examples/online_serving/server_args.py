"""Where the example clients find the server: `--base-url` / `--api-key`, else the openai SDK's own
`OPENAI_BASE_URL` / `OPENAI_API_KEY`, else an unauthenticated `vllm serve` on this machine's port 8000."""

from __future__ import annotations

import argparse
import os

import openai

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", DEFAULT_BASE_URL),
                        help="the server's OpenAI base URL, ending in /v1 (default: $OPENAI_BASE_URL or %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                        help="the key `vllm serve --api-key` was given (default: $OPENAI_API_KEY)")


def client(args: argparse.Namespace) -> openai.OpenAI:
    return openai.OpenAI(base_url=args.base_url, api_key=args.api_key)


def server_url(args: argparse.Namespace) -> str:
    """The base URL without `/v1`, for the routes the openai client does not have (batch chat, WebSocket)."""
    return args.base_url.rstrip("/").removesuffix("/v1")


def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"}
