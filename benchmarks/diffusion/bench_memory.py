"""What the memory features cost: online FP8 and layerwise offload on the whole Qwen-Image pipeline, one process.

Real sizes with random weights (`--load-format dummy` on a config-only checkpoint,
write_config_only_checkpoint.py), 1024^2, through the worker's own loader (`DiffusionModelRunner`), same seed:

    bf16             the resident pipeline as served (compiled on CUDA): the reference
    fp8              --quantization fp8 (compiled): pipeline time and transformer memory vs bf16, PSNR vs bf16
                     (random weights quantize more easily than trained ones: the PSNR is an upper bound)
    bf16 eager       resident, eager: the step time layerwise offload (eager only) is held against
    offload <cap>    --enable-layerwise-offload (+ --enable-cpu-offload) with the GPU capped to <cap> GB by
                     torch.cuda.set_per_process_memory_fraction; each step against
                     bound = max(eager resident step, bytes streamed per step / pinned H2D bandwidth),
                     the bandwidth measured in this run (a 1 GiB pinned copy)

Issue 32's bars: fp8 <= 0.75x bf16 time, transformer memory <= 0.55x; offload step <= 1.15x its bound at 48 and
24 GB. Prints a table, writes JSON (--out) and a PNG (--png). `--device cpu --tiny`: the tiny checkpoint in fp32
on the CPU (every variant runs, no caps), seconds; what CI runs.

  python benchmarks/diffusion/bench_memory.py --out benchmarks/results/bench_memory.json \\
      --png benchmarks/results/bench_memory.png
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dit_forward import environment  # noqa: E402
from write_config_only_checkpoint import write_checkpoint  # noqa: E402

BARS = {"fp8_time": 0.75, "fp8_memory": 0.55, "offload_step": 1.15}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint (CPU smoke test)")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50, help="denoise steps of the bf16 / fp8 runs")
    parser.add_argument("--offload-steps", type=int, default=8, help="denoise steps of the eager / offload runs")
    parser.add_argument("--caps-gb", type=float, nargs="*", default=[48.0, 24.0])
    parser.add_argument("--resident-layers", type=int, default=0, help="--offload-resident-layers")
    parser.add_argument("--prefetch", type=int, default=1, help="--offload-prefetch-layers")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.size, args.steps, args.offload_steps, args.caps_gb = min(args.size, 64), min(args.steps, 3), 2, []
    return args


def h2d_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Bytes per second of a pinned host-to-device copy (a host memcpy on CPU)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return nbytes / float(np.median(times))


def device_bytes(module: torch.nn.Module, device: torch.device) -> int:
    """Bytes of `module`'s parameters and buffers on `device` (an offloaded block's placeholders hold none), plus,
    on CPU, the weights vLLM repacked into oneDNN handles (their parameters are emptied)."""
    from vllm.model_executor.layers.linear import LinearBase

    tensors = [*module.parameters(), *module.buffers()]
    total = sum(t.numel() * t.element_size() for t in tensors if t.device.type == device.type)
    for layer in module.modules():
        if (
            isinstance(layer, LinearBase)
            and getattr(layer, "cpu_linear", None) is not None
            and not getattr(layer, "_cpu_skip_gemm_dispatch", False)
        ):
            total += layer.input_size * layer.output_size * layer.params_dtype.itemsize
    return total


def run_variant(
    label: str, model_dir: Path, device: torch.device, steps: int, size: int, cap_gb: float | None, **flags: Any
) -> tuple[dict[str, Any], np.ndarray]:
    """Load the pipeline with `flags`, run one warm-up request and one timed one; the row and its image."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.offload.layerwise import iter_offloaders
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if cap_gb is None else min(cap_gb * 2**30 / total, 1.0))
        torch.cuda.reset_peak_memory_stats(device)
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    od_config = OmniDiffusionConfig(
        model=str(model_dir),
        dtype=dtype,
        device=device.type,
        load_format="dummy",
        diffusion_warmup_shapes=f"{size}x{size}",
        **flags,
    )
    runner = DiffusionModelRunner(od_config, device)
    start = time.perf_counter()
    runner.load_model()
    load_s = time.perf_counter() - start
    pipe = runner.pipeline
    offloaders = list(iter_offloaders(pipe.transformer))

    def request(n_steps: int) -> OmniDiffusionRequest:
        sp = OmniDiffusionSamplingParams(
            seed=7, height=size, width=size, num_inference_steps=n_steps, true_cfg_scale=4.0
        )
        return OmniDiffusionRequest(
            {"prompt": "a lighthouse on a cliff at dusk", "negative_prompt": "blurry"}, sp, label
        )

    with torch.inference_mode():
        pipe.forward(DiffusionRequestBatch([request(2)]))  # warm-up (kernels, allocator, first fetches)
        fetches = sum(o.fetches for o in offloaders)
        start = time.perf_counter()
        (out,) = pipe.forward(DiffusionRequestBatch([request(steps)]))
        total_s = time.perf_counter() - start
    assert out.error is None, out.error
    row: dict[str, Any] = {
        "variant": label,
        "steps": steps,
        "load_s": round(load_s, 2),
        "pipeline_s": round(total_s, 3),
        "step_ms": round(out.stage_durations["denoise"] / steps * 1000, 2),
        "transformer_bytes": device_bytes(pipe.transformer, device),
        "peak_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "cap_gb": cap_gb,
    }
    if offloaders:
        per_block = sum(o.bytes_per_pass() for o in offloaders) / sum(o.num_offloaded for o in offloaders)
        row["streamed_gb_per_step"] = round(
            (sum(o.fetches for o in offloaders) - fetches) * per_block / steps / 2**30, 3
        )
    image = np.asarray(out.output[0], dtype=np.float64)
    del runner, pipe, offloaders, out
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, image


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def summarise(rows: list[dict[str, Any]], images: dict[str, np.ndarray], bandwidth: float) -> None:
    """Fill each row's ratios against the reference rows measured so far (fp8 vs bf16, offload vs its bound)."""
    by = {row["variant"]: row for row in rows}
    bf16, fp8, eager = by.get("bf16"), by.get("fp8"), by.get("bf16 eager")
    if bf16 and fp8:
        fp8.update(
            x_bf16_time=round(fp8["pipeline_s"] / bf16["pipeline_s"], 3),
            x_bf16_memory=round(fp8["transformer_bytes"] / bf16["transformer_bytes"], 3),
            psnr_vs_bf16_db=round(psnr(images["fp8"], images["bf16"]), 2),
        )
    for row in rows:
        row["transformer_gb"] = round(row["transformer_bytes"] / 2**30, 3)
        if eager and "streamed_gb_per_step" in row:
            bus_ms = row["streamed_gb_per_step"] * 2**30 / bandwidth * 1000
            bound = max(eager["step_ms"], bus_ms)
            row.update(
                bus_ms=round(bus_ms, 2),
                bound_ms=round(bound, 2),
                x_bound=round(row["step_ms"] / bound, 3),
                psnr_vs_eager_db=round(psnr(images[row["variant"]], images["bf16 eager"]), 2),
            )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from vllm_omni.catalog.tiny import build_tiny

    args = parse_args(argv)
    device = torch.device(args.device)
    result: dict[str, Any] = {"env": environment(device), "args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp, _single_rank(device):
        # Real sizes: a config-only checkpoint with dummy weights; --tiny: the tiny checkpoint's own weights (dummy
        # ones would make every image constant, and the PSNRs meaningless).
        model_dir = build_tiny("qwen-image") if args.tiny else write_checkpoint("qwen-image", Path(tmp) / "qwen-image")
        bandwidth = h2d_bandwidth(device)
        result.update(h2d_gb_s=round(bandwidth / 1e9, 2), rows=[], bars=BARS)
        rows, images = result["rows"], {}
        for label, steps, cap, flags in [
            ("bf16", args.steps, None, {}),
            ("fp8", args.steps, None, {"quantization": "fp8"}),
            ("bf16 eager", args.offload_steps, None, {"enforce_eager": True}),
            *[
                (
                    f"offload {cap:g} GB" if cap else "offload",
                    args.offload_steps,
                    cap,
                    {
                        "enable_layerwise_offload": True,
                        "enable_cpu_offload": True,
                        "offload_resident_layers": args.resident_layers,
                        "offload_prefetch_layers": args.prefetch,
                    },
                )
                for cap in (args.caps_gb or [None])
            ],
        ]:
            row, images[label] = run_variant(label, model_dir, device, steps, args.size, cap, **flags)
            rows.append(row)
            summarise(rows, images, bandwidth)
            print(f"[bench_memory] {label}: {row}", flush=True)
            if args.out:  # after every variant: a run cut by a time limit still leaves what it measured
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    if args.png:
        draw(result, args.png)
    return result


class _single_rank:
    """A gloo world of one with vLLM's groups and a current VllmConfig: what the runner's layers need."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> None:
        from vllm.config import set_current_vllm_config

        from vllm_omni.diffusion.data import DiffusionParallelConfig
        from vllm_omni.diffusion.distributed.parallel_state import init_diffusion_distributed

        config = init_diffusion_distributed(
            rank=0, world_size=1, parallel_config=DiffusionParallelConfig(), device=self.device
        )
        self.scope = set_current_vllm_config(config)
        self.scope.__enter__()

    def __exit__(self, *exc: Any) -> None:
        from vllm_omni.diffusion.distributed.parallel_state import destroy_diffusion_distributed

        self.scope.__exit__(*exc)
        destroy_diffusion_distributed()


def print_table(result: dict[str, Any]) -> None:
    cols = [
        "variant",
        "steps",
        "pipeline_s",
        "step_ms",
        "transformer_gb",
        "peak_gb",
        "cap_gb",
        "streamed_gb_per_step",
        "bound_ms",
        "x_bound",
        "x_bf16_time",
        "x_bf16_memory",
        "psnr_vs_bf16_db",
    ]
    print(f"pinned H2D bandwidth: {result['h2d_gb_s']} GB/s; bars: {result['bars']}")
    print(" | ".join(cols))
    for row in result["rows"]:
        print(" | ".join("" if row.get(c) is None else str(row[c]) for c in cols))


def draw(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [r["variant"] for r in rows]
    left.bar(labels, [r["step_ms"] for r in rows], color="tab:blue", label="step")
    bounds = [r.get("bound_ms") for r in rows]
    left.scatter(
        [lab for lab, b in zip(labels, bounds, strict=True) if b],
        [b for b in bounds if b],
        color="k",
        marker="_",
        s=400,
        label="bound (max(resident step, bytes / H2D))",
        zorder=3,
    )
    left.set_ylabel("ms per denoise step")
    left.legend(fontsize=8)
    right.bar(labels, [r["transformer_bytes"] / 2**30 for r in rows], color="tab:orange")
    right.set_ylabel("transformer GiB on the device")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"Qwen-Image {result['args']['size']}^2 on {result['env']['device']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
