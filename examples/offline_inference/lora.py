"""Per-request LoRA: four requests with different adapters (or none) share one transformer forward per step.

    .venv/bin/python examples/offline_inference/lora.py
    .venv/bin/python examples/offline_inference/lora.py --step-execution
    python examples/offline_inference/lora.py --model Qwen/Qwen-Image --lora a=/loras/a.safetensors \\
        --lora b=/loras/b.safetensors --size 1024 --steps 30

Without --lora the script writes two tiny random adapters for the tiny model, in the layout diffusers and PEFT
publish (`vllm_omni/diffusion/model_loader/tiny_lora.py`). Each request names its adapters in
`OmniDiffusionSamplingParams.lora` ({"path", "scale"}; a list adds several up); the engine runs with
enable_lora=True and max_loras=2 (both adapters resident). See docs/lora.md.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from vllm_omni import AsyncOmni, OmniDiffusionSamplingParams


def tiny_adapters(model: str, root: Path) -> dict[str, str]:
    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.diffusion.model_loader.tiny_lora import write_tiny_lora

    model_dir = build_tiny(model.removeprefix("tiny/"))
    return {
        "a": str(write_tiny_lora(model_dir, root / "a.safetensors", rank=4, seed=1)),
        "b": str(write_tiny_lora(model_dir, root / "b.safetensors", rank=8, alpha=4, seed=2)),
    }


async def run(omni: AsyncOmni, adapters: dict[str, str], args: argparse.Namespace) -> None:
    a, b = adapters.values()
    mixes = {
        "none": None,
        "a": {"path": a},
        "b@0.7": {"path": b, "scale": 0.7},
        "a+b": [{"path": a, "scale": 0.5}, {"path": b, "scale": 0.5}],
    }

    async def one(name: str, lora) -> None:
        params = OmniDiffusionSamplingParams(
            height=args.size, width=args.size, num_inference_steps=args.steps, seed=0, lora=lora
        )
        async for out in omni.generate("a lighthouse at dusk", f"lora-{name}", [params]):
            if out.finished:
                if out.error:
                    raise SystemExit(f"{name}: {out.error}")
                out.images[0].save(f"lora_{name}.png")
                denoise = out.stage_durations.get("diffusion.denoise", 0.0)
                print(f"lora_{name}.png  denoise {denoise * 1000:.0f} ms")

    await asyncio.gather(*(one(name, lora) for name, lora in mixes.items()))  # queued together: one batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny/qwen-image")
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="two adapters (default: tiny random ones for the tiny model)",
    )
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--step-execution", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        adapters = dict(item.split("=", 1) for item in args.lora) or tiny_adapters(args.model, Path(tmp))
        if len(adapters) != 2:
            raise SystemExit("give two --lora NAME=PATH")
        batching = {"step_execution": True} if args.step_execution else {"request_batch_max_wait_ms": 200}
        omni = AsyncOmni(args.model, enable_lora=True, max_loras=2, max_lora_rank=64, max_num_seqs=4, **batching)
        try:
            asyncio.run(run(omni, adapters, args))
        finally:
            omni.close()


if __name__ == "__main__":
    main()
