"""Step mode on CPU: what one step round costs beside the model, through the real engine and worker processes.

Tiny Qwen-Image whose transformer prediction is replaced by zeros (`NoopStepPipeline`), so a round is what the
step machinery costs: scheduling, the messages between the engine and the ranks, the ranks' agreement, the
scheduler step of each state. `--states` requests of `--steps` steps each are submitted at once (one state per
forward, `diffusion_max_tokens_per_forward=1`) on 1 rank and on 2 gloo ranks (Ulysses 2); ms per round = wall
time from submit to the last output / rounds, median of `--repeats`. Run it on two checkouts to compare them
(`--label`); prints a table and writes JSON (and a PNG with `--plot` when several result files are given) to
benchmarks/results/.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/diffusion/bench_step_round_overhead.py --label branch
    .venv/bin/python benchmarks/diffusion/bench_step_round_overhead.py --plot A.json B.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline

RESULTS = Path(__file__).resolve().parents[1] / "results"


class NoopStepPipeline(QwenImagePipeline):
    """Tiny Qwen-Image with a zero noise prediction: the round is all that is left to measure."""

    def predict_noise(self, state) -> torch.Tensor:
        return torch.zeros_like(state.latents)

    def forward_group_key(self, state):
        return None


def run(ranks: int, states: int, steps: int) -> float:
    """Seconds from submitting `states` requests to the last output."""
    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    config = OmniDiffusionConfig(model=str(build_tiny("qwen-image")),
                                 model_class_name=f"{Path(__file__).stem}:{NoopStepPipeline.__qualname__}",
                                 parallel_config=DiffusionParallelConfig(ulysses_degree=ranks),
                                 step_execution=True, max_num_seqs=states, diffusion_max_tokens_per_forward=1)
    with DiffusionEngine(config) as engine:
        def submit(i: int):
            params = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=steps, seed=i,
                                                 output_type="np")
            return engine.submit(OmniDiffusionRequest({"prompt": f"a cat {i}"}, params, f"r{i}-{time.monotonic()}"))

        for future in [submit(i) for i in range(states)]:  # warm-up: encoders, first forwards
            assert future.result(300).error is None
        start = time.perf_counter()
        outputs = [future.result(300) for future in [submit(i) for i in range(states)]]
        seconds = time.perf_counter() - start
    assert all(out.error is None for out in outputs), [out.error for out in outputs]
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="this-tree")
    parser.add_argument("--states", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--plot", nargs="+", metavar="JSON", help="plot these result files instead of running")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot)
        return
    rows = []
    for ranks in args.ranks:
        runs = [run(ranks, args.states, args.steps) for _ in range(args.repeats)]
        per_round = statistics.median(runs) / args.steps * 1000
        rows.append({"ranks": ranks, "states": args.states, "steps": args.steps, "seconds": runs,
                     "ms_per_round": per_round, "ms_per_state_step": per_round / args.states})
        print(f"{args.label:>12} ranks={ranks} states={args.states}: {per_round:7.2f} ms/round "
              f"({per_round / args.states:6.2f} ms per state-step), runs {[f'{s:.2f}' for s in runs]} s")
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"bench_step_round_overhead-{args.label}-{stamp}.json"
    out.write_text(json.dumps({"label": args.label, "host": platform.node(), "python": sys.version.split()[0],
                               "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"wrote {out}")


def plot(paths: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(Path(p).read_text()) for p in paths]
    fig, ax = plt.subplots(figsize=(6, 4))
    ranks = sorted({row["ranks"] for r in results for row in r["rows"]})
    width = 0.8 / len(results)
    print(f"{'label':>12} " + " ".join(f"{f'{n} rank(s) ms/round':>20}" for n in ranks))
    for i, result in enumerate(results):
        by_ranks = {row["ranks"]: row["ms_per_round"] for row in result["rows"]}
        ax.bar([r + (i - (len(results) - 1) / 2) * width for r in ranks], [by_ranks[r] for r in ranks], width,
               label=result["label"])
        print(f"{result['label']:>12} " + " ".join(f"{by_ranks[r]:>20.2f}" for r in ranks))
    ax.set_xticks(ranks)
    ax.set_xlabel("gloo ranks")
    ax.set_ylabel("ms per step round (median)")
    ax.set_title("Step-round overhead, zero-prediction tiny Qwen-Image, CPU")
    ax.legend()
    out = RESULTS / f"bench_step_round_overhead-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.png"
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
