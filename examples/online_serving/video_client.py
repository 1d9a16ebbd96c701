"""Talk to `vllm serve <wan model> --omni`: the Videos API (openai client) or the streaming WebSocket.

    vllm serve tiny/wan2.1-t2v --omni --port 8000 &
    .venv/bin/python examples/online_serving/video_client.py                 # create -> poll -> download MP4
    .venv/bin/python examples/online_serving/video_client.py --stream        # /v1/realtime/video, fMP4 chunks
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import server_args


def via_videos_api(args: argparse.Namespace) -> bytes:
    client = server_args.client(args)
    job = client.videos.create(prompt=args.prompt, size=args.size,
                               extra_body={"num_frames": args.frames, "num_inference_steps": args.steps,
                                           "seed": args.seed})
    while job.status not in ("completed", "failed"):
        time.sleep(1.0)
        job = client.videos.retrieve(job.id)
        print(f"{job.id}: {job.status} {job.progress}%")
    if job.status == "failed":
        raise SystemExit(f"generation failed: {job.error}")
    return client.videos.download_content(job.id).read()


def via_websocket(args: argparse.Namespace) -> bytes:
    from websockets.sync.client import connect

    url = server_args.server_url(args).replace("http", "ws", 1) + "/v1/realtime/video"
    data = b""
    with connect(url, additional_headers=server_args.auth_headers(args)) as ws:
        ws.send(json.dumps({"type": "session.start", "prompt": args.prompt, "frames_per_chunk": 4,
                            "sampling_params": {"size": args.size, "num_frames": args.frames,
                                                "num_inference_steps": args.steps, "seed": args.seed}}))
        while True:
            msg = json.loads(ws.recv(timeout=3600))
            print(msg)
            if msg["type"] == "video.chunk_metadata":
                data += ws.recv(timeout=60)  # append-able fMP4: chunk 0 starts with the init segment
            elif msg["type"] in ("session.done", "error"):
                break
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server_args.add_server_args(parser)
    parser.add_argument("--prompt", default="A red car drives along a coastal road at sunset.")
    parser.add_argument("--size", default="48x32", help="WIDTHxHEIGHT")
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream", action="store_true", help="use the WebSocket instead of the Videos API")
    parser.add_argument("--out", default="video.mp4")
    args = parser.parse_args()
    data = via_websocket(args) if args.stream else via_videos_api(args)
    Path(args.out).write_bytes(data)
    print(f"saved {args.out} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
