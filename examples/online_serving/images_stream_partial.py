"""Stream an image generation with partial images (OpenAI image streaming) through `vllm serve ... --omni`.

Each `image_generation.partial_image` event is a decoded preview at an evenly spaced denoise step; the
`image_generation.completed` event is the final image. `--priority` / `--deadline-ms` are the scheduling fields
of `--diffusion-scheduler-policy priority|slo` servers; without `--deadline-ms` an slo server gives the request
arrival + `--slo-deadline-factor` (default 2) x its estimated solo time, so short requests go first anyway. A server
with `--slo-admission-control` refuses a request that cannot make its deadline behind the queue with a 429 naming
`deadline_ms` (within its `--slo-admission-min-accept` floor); this client then says so and exits 1 instead of
retrying (the openai client retries a 429 by default).

    vllm serve tiny/qwen-image --omni --port 8000 --step-execution --max-num-seqs 2 &
    .venv/bin/python examples/online_serving/images_stream_partial.py --partial-images 2 --out lighthouse.png
"""

from __future__ import annotations

import argparse
import base64
import sys
from pathlib import Path

import openai
import server_args


def main() -> None:
    parser = argparse.ArgumentParser()
    server_args.add_server_args(parser)
    parser.add_argument("--prompt", default="a lighthouse on a cliff at dusk")
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--partial-images", type=int, default=2, choices=range(4))
    parser.add_argument("--priority", type=int, default=None)
    parser.add_argument("--deadline-ms", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("image.png"))
    args = parser.parse_args()

    client = server_args.client(args).with_options(max_retries=0)
    extra = {"num_inference_steps": args.steps, "seed": args.seed}
    extra.update({k: v for k, v in (("priority", args.priority), ("deadline_ms", args.deadline_ms)) if v is not None})
    try:
        stream = client.images.generate(prompt=args.prompt, size=args.size, stream=True,
                                        partial_images=args.partial_images, extra_body=extra)
    except openai.RateLimitError as exc:  # admission control: the deadline cannot be met now
        sys.exit(f"refused ({exc.param}): {exc.message}")
    for event in stream:
        if event.type == "image_generation.partial_image":
            path = args.out.with_stem(f"{args.out.stem}-partial{event.partial_image_index}")
        else:
            path = args.out
        path.write_bytes(base64.b64decode(event.b64_json))
        print(f"{event.type}: {event.size} -> {path}")


if __name__ == "__main__":
    main()
