"""Stream a Wan video while it is generated: denoise progress, then each decoded chunk as an fMP4 fragment.

    .venv/bin/python examples/offline_inference/wan_video_streaming.py              # tiny/wan2.1-t2v, CPU
    python examples/offline_inference/wan_video_streaming.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers \\
        --height 480 --width 832 --frames 81 --steps 50
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from vllm_omni import OmniDiffusionSamplingParams
from vllm_omni.diffusion.video_utils import FragmentedMp4Writer
from vllm_omni.entrypoints.async_omni import AsyncOmni


async def stream(omni: AsyncOmni, args: argparse.Namespace) -> bytes:
    params = OmniDiffusionSamplingParams(height=args.height, width=args.width, num_frames=args.frames,
                                         num_inference_steps=args.steps, seed=args.seed, stream_partial_outputs=True)
    start, data, writer = time.perf_counter(), b"", None
    async for out in omni.generate(args.prompt, "stream-0", [params]):
        mm = out.multimodal_output
        if "progress" in mm:
            step, total = mm["progress"]["step"], mm["progress"]["total"]
            print(f"{time.perf_counter() - start:6.2f} s  denoise step {step}/{total}")
        elif "video_chunk" in mm:
            chunk = mm["video_chunk"]
            writer = writer or FragmentedMp4Writer(mm["fps"], chunk.shape[2], chunk.shape[1])
            data += await asyncio.to_thread(writer.write, chunk)  # a player could append these bytes now
            print(f"{time.perf_counter() - start:6.2f} s  frames {mm['frame_start']}..{mm['frame_start'] + len(chunk)}"
                  f" decoded; {writer.frames_flushed} frames in finished fragments")
        elif out.finished:
            print(f"{time.perf_counter() - start:6.2f} s  done; stage durations {out.stage_durations}")
    return data + writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny/wan2.1-t2v", help="hub id, path or tiny/<name>")
    parser.add_argument("--prompt", default="A cat walks on the grass, camera slowly pans left.")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--frames", type=int, default=17, help="4k+1")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="wan_stream.mp4")
    args = parser.parse_args()
    omni = AsyncOmni(args.model)
    try:
        Path(args.out).write_bytes(asyncio.run(stream(omni, args)))
        print(f"saved {args.out}")
    finally:
        omni.close()


if __name__ == "__main__":
    main()
