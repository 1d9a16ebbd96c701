"""Generate a video with Wan 2.1 / 2.2 through `Omni` and save it as MP4.

    .venv/bin/python examples/offline_inference/wan_video.py                          # tiny/wan2.1-t2v, CPU
    .venv/bin/python examples/offline_inference/wan_video.py --model tiny/wan2.2-t2v-a14b --guidance-2 3.0
    .venv/bin/python examples/offline_inference/wan_video.py --model tiny/wan2.1-i2v   # a random first frame
    .venv/bin/python examples/offline_inference/qwen_image.py --height 32 --width 48 --out first_frame.png
    .venv/bin/python examples/offline_inference/wan_video.py --model tiny/wan2.1-i2v --image first_frame.png
    python examples/offline_inference/wan_video.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers \\
        --height 480 --width 832 --frames 81 --steps 50
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.diffusion.video_utils import encode_mp4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny/wan2.1-t2v", help="hub id, path or tiny/<name>")
    parser.add_argument("--prompt", default="A cat walks on the grass, camera slowly pans left.")
    parser.add_argument("--negative-prompt", default=None)
    parser.add_argument("--image", default=None, help="first frame for image-to-video models")
    parser.add_argument("--height", type=int, default=32)
    parser.add_argument("--width", type=int, default=48)
    parser.add_argument("--frames", type=int, default=17, help="4k+1 (other values are rounded down)")
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--guidance-2", type=float, default=None, help="Wan2.2 A14B low-noise expert guidance")
    parser.add_argument("--flow-shift", type=float, default=None, help="override the scheduler's flow_shift")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="wan_video.mp4")
    args = parser.parse_args()

    prompt: str | dict = args.prompt
    if args.image or "i2v" in args.model.lower():
        image = Image.open(args.image) if args.image else Image.fromarray(
            (np.random.RandomState(0).rand(args.height, args.width, 3) * 255).astype("uint8"))
        prompt = {"prompt": args.prompt, "multi_modal_data": {"image": image}}
    params = OmniDiffusionSamplingParams(
        height=args.height, width=args.width, num_frames=args.frames, fps=args.fps, num_inference_steps=args.steps,
        guidance_scale=args.guidance, guidance_scale_2=args.guidance_2, flow_shift=args.flow_shift,
        negative_prompt=args.negative_prompt, seed=args.seed)
    omni = Omni(model=args.model, enable_progress_bar=True)
    try:
        output = omni.generate([prompt], params)[0]
        if output.error:
            raise SystemExit(f"request failed: {output.error}")
        frames, fps = output.multimodal_output["video"], output.multimodal_output["fps"]
        Path(args.out).write_bytes(encode_mp4(frames, fps))
        print(f"saved {args.out}: {frames.shape[0]} frames of {frames.shape[2]}x{frames.shape[1]} at {fps} fps; "
              f"stage durations: {output.stage_durations}")
    finally:
        omni.close()


if __name__ == "__main__":
    main()
