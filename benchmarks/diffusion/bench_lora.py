"""Per-request LoRA cost: one DiT forward over a batch whose rows run different adapters, against the same batch
without LoRA, same process, same weights (issue 29's bar: 4 rows with 4 different rank-32 adapters at 1024^2
within 1.15x of the plain forward on an H200).

Builds our real-size transformer (Qwen-Image 20.4B or FLUX.1-dev 11.9B) with random bf16 weights on the GPU,
writes random adapters on every attention and MLP projection of the blocks (diffusers module names, the layout
diffusers / PEFT publish; `vllm_omni/diffusion/model_loader/tiny_lora.py`), loads them through the serving path
(`LoRAManager`: diffusers' `lora_state_dict`, our sharding and hooks), and times the eager forward:

    no LoRA            the transformer before any adapter was loaded (no hooks)
    hooks, no adapter  adapters resident, this batch uses none (what a plain request pays on a LoRA server)
    1 adapter          every row the same adapter
    N adapters         row i its own adapter (the co-batched case)

Prints a table, writes JSON (--out) and a PNG (--png). `--smoke`: tiny configs on the CPU (fp32), seconds.

  python benchmarks/diffusion/bench_lora.py --model qwen-image --size 1024 --batch 4 --rank 32 \\
      --out benchmarks/results/bench_lora.json --png benchmarks/results/bench_lora.png
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dit_forward import (  # noqa: E402 (the sibling benchmark's harness)
    FLUX_CONFIG,
    QWEN_CONFIG,
    SMOKE,
    TEXT_TOKENS,
    environment,
    make_inputs,
    timed,
    vllm_single_rank,
)

LOADERS = {"qwen-image": "QwenImageLoraLoaderMixin", "flux": "FluxLoraLoaderMixin"}


def build(name: str, config: dict, device: torch.device, dtype: torch.dtype):
    """(our transformer with random weights, diffusers module name -> (out, in) of every block projection)."""
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_omni.diffusion.model_loader.tiny_lora import BLOCK_PROJECTIONS
    from vllm_omni.diffusion.model_loader.weight_utils import process_weights_after_loading

    reference_cls = FluxTransformer2DModel if name == "flux" else QwenImageTransformer2DModel
    with torch.device("meta"):
        reference = reference_cls(**config)
    shapes = {
        n: (m.out_features, m.in_features)
        for n, m in reference.named_modules()
        if isinstance(m, torch.nn.Linear) and BLOCK_PROJECTIONS.search(n)
    }
    torch.manual_seed(0)
    with set_default_torch_dtype(dtype), torch.device(device):
        if name == "flux":
            from vllm_omni.models.flux.transformer import FluxTransformer2DModel as Ours

            model = Ours(**config)
        else:
            from vllm_omni.models.qwen_image.transformer import QwenImageTransformer2DModel as Ours
            from vllm_omni.models.qwen_image.transformer import QwenImageTransformerConfig

            model = Ours(config=QwenImageTransformerConfig.from_dict(config))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    process_weights_after_loading(model)
    return model.eval(), shapes


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import diffusers.loaders

    from vllm_omni.diffusion.lora import LoRAManager
    from vllm_omni.diffusion.model_loader.tiny_lora import write_lora
    from vllm_omni.inputs.lora import LoRARef

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = SMOKE[args.model] if args.smoke else {"flux": FLUX_CONFIG, "qwen-image": QWEN_CONFIG}[args.model]
    model, shapes = build(args.model, config, device, dtype)
    _, call = make_inputs(args.model, config, args.size, args.batch, TEXT_TOKENS[args.model], device, dtype, model)
    rows: list[dict[str, Any]] = []

    def measure(variant: str, adapters: list[list[tuple[str, float]]] | None) -> None:
        def forward():
            with torch.inference_mode():
                if adapters is None or not any(adapters):
                    return call(model, step_table=True)
                with manager.forward_rows(adapters):
                    return call(model, step_table=True)

        median, best = timed(forward, device, args.warmup, args.iters)
        base = rows[0]["ms_median"] if rows else median
        rows.append(
            {
                "model": args.model,
                "size": args.size,
                "batch": args.batch,
                "rank": args.rank,
                "variant": variant,
                "ms_median": round(median, 3),
                "ms_min": round(best, 3),
                "x_no_lora": round(median / base, 3),
            }
        )
        print(f"{variant:<20}{median:10.2f} ms{median / base:8.3f}x", flush=True)

    measure("no LoRA", None)
    manager = LoRAManager(
        {"transformer": model},
        getattr(diffusers.loaders, LOADERS[args.model]),
        max_loras=args.batch,
        max_lora_rank=args.rank,
        device=device,
    )
    with tempfile.TemporaryDirectory() as tmp:
        keys = [
            manager.load(
                LoRARef(
                    f"a{i}",
                    str(write_lora(shapes, Path(tmp) / f"a{i}.safetensors", rank=args.rank, seed=i, std=0.01)),
                    1.0,
                )
            )
            for i in range(args.batch)
        ]
    measure("hooks, no adapter", [[] for _ in range(args.batch)])
    measure("1 adapter", [[(keys[0], 1.0)] for _ in range(args.batch)])
    measure(f"{args.batch} adapters", [[(key, 1.0)] for key in keys])
    return rows


def draw(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([r["variant"] for r in rows], [r["ms_median"] for r in rows], color=["#888", "#6a9", "#48c", "#c64"])
    for i, r in enumerate(rows):
        ax.text(i, r["ms_median"], f"{r['x_no_lora']:.2f}x", ha="center", va="bottom")
    first = rows[0]
    ax.set_title(f"{first['model']} {first['size']}^2, batch {first['batch']}, rank {first['rank']}: forward ms")
    ax.set_ylabel("ms (median)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen-image", choices=sorted(LOADERS))
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny config on the CPU (fp32), seconds")
    parser.add_argument("--out", type=Path, default=None, help="JSON results path")
    parser.add_argument("--png", type=Path, default=None, help="bar chart path")
    args = parser.parse_args(argv)
    if args.smoke:
        args.size, args.warmup, args.iters, args.rank = 64, 1, 2, 4
    if args.size % 16:
        parser.error("--size must be a multiple of 16")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    env = environment(device)
    with vllm_single_rank(device):
        rows = run(args)
    result = {"command": " ".join(sys.argv), "env": env, "rows": rows}
    print(f"\n{'variant':<20}{'ms':>10}{'x no LoRA':>11}")
    for r in rows:
        print(f"{r['variant']:<20}{r['ms_median']:10.2f}{r['x_no_lora']:11.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    if args.png:
        draw(rows, args.png)
    return result


if __name__ == "__main__":
    main()
