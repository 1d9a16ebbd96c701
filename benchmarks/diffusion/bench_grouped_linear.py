"""The GEMMs of an MMDiT forward: each stream's own linear vs one grouped GEMM over both streams.

A dual-stream block (Qwen-Image, FLUX double blocks) runs every projection twice, once with the image stream's
weights on the image tokens and once with the text stream's weights on the few text tokens. The text GEMMs are
weight-bound (M = prompt tokens) and cannot overlap the compute-bound image GEMMs on another stream. A grouped
GEMM (`torch._grouped_mm`, text rows then image rows, weights stacked (2, N, K)) runs both as one launch where
the text rows cost one more row of tiles. This times the 4 projections x `--layers` blocks at real sizes, each
variant captured as one CUDA graph (distinct weights per block so none stay in L2), and writes JSON.

  python benchmarks/diffusion/bench_grouped_linear.py --image-tokens 1024 4096 --text-tokens 128 14 --out r.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# (name, N, K) of one block's projections, Qwen-Image / FLUX double block (dim 3072, MLP 12288).
PROJECTIONS = (("qkv", 9216, 3072), ("out", 3072, 3072), ("up", 12288, 3072), ("down", 3072, 12288))


def make_layers(layers: int, device: torch.device) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Per block and projection: stacked weights (2, N, K) [text, image] and biases (2, N)."""
    return [{name: (torch.randn(2, n, k, device=device, dtype=torch.bfloat16) * k**-0.5,
                    torch.randn(2, n, device=device, dtype=torch.bfloat16) * 0.01)
             for name, n, k in PROJECTIONS} for _ in range(layers)]


def separate(layer, name, txt, img, gelu=False):
    """Today's path: one cuBLAS GEMM per stream, bias (and GELU) in the epilogue."""
    w, b = layer[name]
    if gelu:
        return (torch._addmm_activation(b[0], txt, w[0].t(), use_gelu=True),
                torch._addmm_activation(b[1], img, w[1].t(), use_gelu=True))
    return F.linear(txt, w[0], b[0]), F.linear(img, w[1], b[1])


def grouped(layer, name, joint, offs):
    """One grouped GEMM over [text rows; image rows]; bias left to the consumer's pointwise kernel."""
    w, _ = layer[name]
    return torch._grouped_mm(joint, w.transpose(-2, -1), offs=offs)


def graph_ms(fn, iters: int) -> float:
    """Median ms of replaying `fn` captured as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def projection_row(layers, name: str, n: int, k: int, m_txt: int, m_img: int, iters: int) -> dict:
    """One projection over all blocks: separate vs grouped, and the image GEMM alone (the floor)."""
    device = layers[0]["qkv"][0].device
    offs = torch.tensor([m_txt, m_txt + m_img], device=device, dtype=torch.int32)
    joint = torch.randn(m_txt + m_img, k, device=device, dtype=torch.bfloat16)
    txt, img = joint[:m_txt], joint[m_txt:]
    gelu = name == "up"
    row = dict(projection=name, n=n, k=k)
    row["separate_ms"] = graph_ms(lambda: [separate(layer, name, txt, img, gelu) for layer in layers], iters)
    row["image_only_ms"] = graph_ms(lambda: [F.linear(img, layer[name][0][1], layer[name][1][1])
                                             for layer in layers], iters)
    row["grouped_ms"] = graph_ms(lambda: [grouped(layer, name, joint, offs) for layer in layers], iters)
    if gelu:  # what a grouped up-projection costs with its bias + GELU as a separate pass
        row["grouped_gelu_pass_ms"] = graph_ms(lambda: [
            F.gelu(grouped(layer, name, joint, offs) + layer[name][1][1], approximate="tanh") for layer in layers
        ], iters)
    row["grouped_tflops"] = 2 * (m_txt + m_img) * n * k * len(layers) / row["grouped_ms"] / 1e9
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image-tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--text-tokens", type=int, nargs="+", default=[128, 14])
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    layers = make_layers(args.layers, device)
    results = []
    for m_img in args.image_tokens:
        for m_txt in args.text_tokens:
            joint = torch.randn(m_txt + m_img, 3072, device=device, dtype=torch.bfloat16)
            txt, img = joint[:m_txt], joint[m_txt:]
            offs = torch.tensor([m_txt, m_txt + m_img], device=device, dtype=torch.int32)
            # Numerics first: grouped == separate (bias-free qkv of block 0).
            w = layers[0]["qkv"][0]
            ref = torch.cat([txt @ w[0].t(), img @ w[1].t()])
            err = (grouped(layers[0], "qkv", joint, offs) - ref).abs().max().item()
            row = dict(image_tokens=m_img, text_tokens=m_txt, max_abs_err_vs_cublas=err,
                       projections=[projection_row(layers, *proj, m_txt, m_img, args.iters)
                                    for proj in PROJECTIONS])
            for key in ("separate_ms", "grouped_ms", "image_only_ms"):
                row[key] = sum(p[key] for p in row["projections"])
            results.append(row)
            print(f"\nimage {m_img} + text {m_txt} tokens, {args.layers} blocks (max |grouped - cuBLAS| {err:.3g})")
            print(f"  all projections: separate {row['separate_ms']:.2f} ms | grouped {row['grouped_ms']:.2f} ms"
                  f" | image stream alone {row['image_only_ms']:.2f} ms")
            print(f"  {'proj':6s} {'separate':>9s} {'image only':>10s} {'grouped':>8s} {'TFLOP/s grp':>11s}")
            for p in row["projections"]:
                print(f"  {p['projection']:6s} {p['separate_ms']:9.2f} {p['image_only_ms']:10.2f} "
                      f"{p['grouped_ms']:8.2f} {p['grouped_tflops']:11.0f}"
                      + (f"  (+ bias/GELU pass: {p['grouped_gelu_pass_ms']:.2f})" if p["projection"] == "up" else ""))
    if args.out:
        env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), python=platform.python_version(),
                   date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(env=env, args=vars(args) | {"out": str(args.out)}, rows=results),
                                       indent=1))


if __name__ == "__main__":
    main()
