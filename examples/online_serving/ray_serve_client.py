"""Many concurrent image requests to vllm-omni on Ray Serve, and which replica answered each (docs/scale_out.md).

ray start --head --node-ip-address 127.0.0.1
serve run recipes/ray_serve_qwen_image.yaml &
.venv/bin/python examples/online_serving/ray_serve_client.py --requests 40
"""

from __future__ import annotations

import argparse
import collections
import time
from concurrent.futures import ThreadPoolExecutor

import server_args

REPLICA_HEADER = "x-omni-replica"


def main() -> None:
    parser = argparse.ArgumentParser()
    server_args.add_server_args(parser)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    client = server_args.client(args)

    def generate(i: int) -> str:
        raw = client.images.with_raw_response.generate(
            prompt=f"a lighthouse number {i}", size=args.size, extra_body={"num_inference_steps": args.steps, "seed": i}
        )
        raw.parse()
        return raw.headers.get(REPLICA_HEADER, "?")

    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        replicas = collections.Counter(pool.map(generate, range(args.requests)))
    elapsed = time.perf_counter() - start
    print(f"{args.requests} requests in {elapsed:.1f} s ({args.requests / elapsed:.2f} req/s)")
    for replica, count in replicas.most_common():
        print(f"  replica {replica}: {count}")


if __name__ == "__main__":
    main()
