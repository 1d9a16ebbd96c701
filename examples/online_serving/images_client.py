"""Generate (and edit) images through `vllm serve <image model> --omni` with the official openai client.

    vllm serve tiny/qwen-image --omni --port 8000 &
    .venv/bin/python examples/online_serving/images_client.py --prompt "a red cube" --out cube.png
    # an edit model takes an input image:
    vllm serve tiny/qwen-image-edit --omni --port 8000 &
    .venv/bin/python examples/online_serving/images_client.py --edit cube.png --prompt "make it blue"
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

import server_args


def main() -> None:
    parser = argparse.ArgumentParser()
    server_args.add_server_args(parser)
    parser.add_argument("--prompt", default="a lighthouse on a cliff at dusk")
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--edit", type=Path, help="input image: use /v1/images/edits")
    parser.add_argument("--out", type=Path, default=Path("image.png"))
    args = parser.parse_args()

    client = server_args.client(args)
    extra = {"num_inference_steps": args.steps, "seed": args.seed}
    if args.edit:
        image = (args.edit.name, args.edit.read_bytes(), "image/png")
        result = client.images.edit(image=image, prompt=args.prompt, size=args.size, n=args.n, extra_body=extra)
    else:
        result = client.images.generate(prompt=args.prompt, size=args.size, n=args.n, extra_body=extra)
    for i, item in enumerate(result.data):
        path = args.out if len(result.data) == 1 else args.out.with_stem(f"{args.out.stem}-{i}")
        path.write_bytes(base64.b64decode(item.b64_json))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
