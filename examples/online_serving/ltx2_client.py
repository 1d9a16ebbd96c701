"""Talk to `vllm serve <LTX-2 model> --omni`: a video with its soundtrack through the Videos API (openai client),
saved as an MP4 (H.264 video + FLAC audio) that any player plays with sound.

    vllm serve tiny/ltx2 --omni --port 8000 &
    .venv/bin/python examples/online_serving/ltx2_client.py --out dog.mp4
    .venv/bin/python examples/online_serving/ltx2_client.py --image first_frame.png   # image-to-video
    .venv/bin/python examples/online_serving/ltx2_client.py --two-stage --size 128x64  # base 64x32, upsampled x2

Two-stage's refine pass runs the checkpoint's distilled LoRA when the server has LoRA on (`vllm serve tiny/ltx2
--omni --enable-lora`; the real Lightricks/LTX-2's is rank 384: add `--max-lora-rank 384`); `--refine-lora PATH`
sends another file as the request's `refine_lora`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import server_args

from vllm_omni.diffusion.video_utils import decode_mp4, decode_mp4_audio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server_args.add_server_args(parser)
    parser.add_argument("--prompt", default="A dog barks and runs through a field of flowers.")
    parser.add_argument("--size", default="64x32", help="WIDTHxHEIGHT (multiples of 32)")
    parser.add_argument("--frames", type=int, default=9, help="8k+1 at the real VAE")
    parser.add_argument("--fps", type=int, default=24)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image", type=Path, default=None, help="first frame (image-to-video)")
    parser.add_argument(
        "--two-stage",
        action="store_true",
        help="two-stage generation: base pass at half --size, latent upsampler x2, 3 refine steps "
        "(--size multiples of 64)",
    )
    parser.add_argument(
        "--refine-lora", default=None, help="with --two-stage: the refine pass's LoRA file (a path the server reads)"
    )
    parser.add_argument("--out", default="ltx2.mp4")
    args = parser.parse_args()
    extra = {"num_frames": args.frames, "fps": args.fps, "num_inference_steps": args.steps, "seed": args.seed}
    if args.two_stage:
        extra["two_stage"] = True
    if args.refine_lora:
        extra["refine_lora"] = {"path": args.refine_lora}
    client = server_args.client(args)
    # The SDK sends a multipart form: the first frame goes as the `input_reference` file.
    image = {} if args.image is None else {"input_reference": (args.image.name, args.image.read_bytes(), "image/png")}
    job = client.videos.create(prompt=args.prompt, size=args.size, extra_body=extra, **image)
    while job.status not in ("completed", "failed"):
        time.sleep(1.0)
        job = client.videos.retrieve(job.id)
        print(f"{job.id}: {job.status} {job.progress}%")
    if job.status == "failed":
        raise SystemExit(f"generation failed: {job.error}")
    data = client.videos.download_content(job.id).read()
    Path(args.out).write_bytes(data)
    audio, rate = decode_mp4_audio(data)
    print(
        f"saved {args.out}: {decode_mp4(data).shape[0]} frames, soundtrack {audio.shape[0]} ch x "
        f"{audio.shape[1]} samples at {rate} Hz"
    )


if __name__ == "__main__":
    main()
