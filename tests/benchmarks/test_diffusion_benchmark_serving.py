"""The serving benchmark against a live `vllm serve tiny/flux --omni` (real server process, real FLUX pipeline):
pins that it drives /v1/images/generations with bounded concurrency and a Poisson rate, counts every image, and
reports latency percentiles and the server's per-stage durations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.entrypoints.openai.live_server import LiveServer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "diffusion"))


@pytest.fixture(scope="module")
def server(stop_later):
    srv = LiveServer("tiny/flux")
    yield srv
    stop_later(srv)


@pytest.mark.timeout(400)
def test_poisson_rate_with_concurrency_limit(server, tmp_path):
    import diffusion_benchmark_serving as bench

    out = tmp_path / "serve.json"
    result = bench.main(["--base-url", server.url, "--num-prompts", "4", "--max-concurrency", "2",
                         "--request-rate", "20", "--size", "64x64", "--n", "2", "--num-inference-steps", "2",
                         "--offline-images-per-s", "1.0", "--out", str(out)])
    summary = result["summary"]
    assert summary["completed"] == 4 and summary["failed"] == 0, summary["errors"]
    assert summary["images_per_s"] == pytest.approx(8 / summary["duration_s"])
    assert 0 < summary["latency_p50_s"] <= summary["latency_p99_s"] <= summary["duration_s"]
    stages = set(summary["stage_durations_mean_s"])
    assert {"diffusion.text_encoder", "diffusion.denoise", "diffusion.vae_decode"} <= stages
    assert out.exists() and summary["serving_over_offline"] == pytest.approx(summary["images_per_s"] / 1.0)


def test_compare_modes_summary():
    """--compare-modes' pure parts (its servers are started by the benchmark run itself, not in CI)."""
    import diffusion_benchmark_serving as bench

    assert bench.parse_mix("64x64:4,128x128:8") == [("64x64", 4), ("128x128", 8)]
    assert set(bench.MODES) == {"request-fcfs", "step-fcfs", "step-slo", "step-slo-admit"}
    plan = [(0.0, 0), (0.1, 1), (0.2, 1), (0.3, 0)]
    results = [bench.RequestResult(True, 1.0), bench.RequestResult(True, 5.0), bench.RequestResult(True, 3.0),
               bench.RequestResult(False, 0.5, error="HTTP 500")]
    summary = bench.mode_summary(results, plan, deadlines=[2.0, 4.0], duration=10.0, mix=[("64x64", 4), ("1x1", 8)])
    assert summary["completed"] == 3 and summary["failed"] == 1 and summary["throughput_rps"] == 0.3
    assert summary["deadline_attainment"] == 0.5  # 1.0 <= 2 and 3.0 <= 4 made it; 5.0 > 4 and the failure did not
    assert summary["latency_mean_s"] == pytest.approx(3.0) and summary["latency_p50_s"] == 3.0
    first, second = summary["per_class"]["64x64:4"], summary["per_class"]["1x1:8"]
    assert (first["sent"], first["completed"], first["deadline_attainment"]) == (2, 1, 0.5)
    assert second["latency_mean_s"] == pytest.approx(4.0) and second["deadline_attainment"] == 0.5
    base = {"latency_mean_s": 10.0, "latency_p95_s": 20.0, "deadline_attainment": 0.5, "throughput_rps": 1.0,
            "per_class": {"128x128:8": {"latency_mean_s": 6.0}, "64x64:4": {"latency_mean_s": 4.0}}}
    step = {"latency_mean_s": 7.0, "latency_p95_s": 22.5, "deadline_attainment": 0.7, "throughput_rps": 1.29,
            "per_class": {"128x128:8": {"latency_mean_s": 9.0}, "64x64:4": {"latency_mean_s": 2.0}}}
    assert bench.target_checks(base, step, 1.3) == {"mean<=0.8x": True, "p95<=1.1x": False, "64x64:4 mean<=0.5x": True,
                                                   "attainment>=70%": True, "throughput>=1.3x": False}
    step["per_class"]["64x64:4"]["latency_mean_s"] = 2.5
    assert not bench.target_checks(base, step, 1.3)["64x64:4 mean<=0.5x"]
    assert bench.parse_args(["--compare-modes", "m"]).num_prompts == 40
    assert bench.parse_args(["--compare-modes", "m", "--smoke"]).num_prompts == 3
    plan_a, plan_b = bench.poisson_plan(2.0, 5, 3, seed=1), bench.poisson_plan(2.0, 5, 3, seed=2)
    assert plan_a == bench.poisson_plan(2.0, 5, 3, seed=1) != plan_b and {c for _, c in plan_a} <= {0, 1, 2}
    pooled = bench.pooled_summary([(results, plan, 10.0, [1.0, 2.0]), (results[:2], plan[:2], 5.0, [3.0, 4.0])],
                                  deadlines=[2.0, 4.0], mix=[("64x64", 4), ("1x1", 8)])
    assert pooled["completed"] == 5 and pooled["throughput_rps"] == pytest.approx(5 / 15.0)
    assert pooled["loadavg_1m"] == [1.0, 4.0] and [r["completed"] for r in pooled["rounds"]] == [3, 2]
    assert bench.parse_args(["--compare-modes", "m", "--rounds", "3"]).rounds == 3
    # Fair baseline: request mode gets the same --max-num-seqs as the step modes (it was pinned to 1).
    args = bench.parse_args(["--compare-modes", "m", "--step-max-num-seqs", "8",
                             "--server-args", "--load-format dummy"])
    flags = {mode: bench.mode_flags(args, mode) for mode in bench.MODES}
    for mode, got in flags.items():
        assert got[got.index("--max-num-seqs") + 1] == "8" and got.count("--max-num-seqs") == 1, mode
        assert got[-2:] == ["--load-format", "dummy"]
    assert "--step-execution" not in flags["request-fcfs"] and "--step-execution" in flags["step-slo"]
    # Every server warms up the mix's sizes (no compile while the plan replays), unless --server-args says so.
    default_mix = "128x128,256x256"
    assert all(got[got.index("--diffusion-warmup-shapes") + 1] == default_mix for got in flags.values())
    args = bench.parse_args(["--compare-modes", "m", "--server-args", "--diffusion-warmup-shapes 64x64"])
    assert bench.mode_flags(args, "step-slo").count("--diffusion-warmup-shapes") == 1


def test_compare_modes_prints_the_simulators_prediction_beside():
    """The simulator replays the run's mix at its offered rate, step costs from the measured solo latencies."""
    import diffusion_benchmark_serving as bench

    args = bench.parse_args(["--compare-modes", "m", "--num-prompts", "12", "--max-num-seqs", "4"])
    mix = [("512x512", 20), ("512x512", 50), ("1024x1024", 20)]
    report = {"solo_latency_s": {"512x512:20": 1.1, "512x512:50": 2.6, "1024x1024:20": 2.8}, "request_rate": 0.4}
    sim = bench.simulated(report, args, mix)
    step = dict(item.split("=") for item in sim["argv"][sim["argv"].index("--step-seconds") + 1].split(","))
    assert float(step["512x512"]) == pytest.approx(0.05) and float(step["1024x1024"]) == pytest.approx(0.14)
    assert set(sim["modes"]) == {"request-fcfs", "step-fcfs", "step-slo", "step-slo-admit"}
    assert sim["modes"]["step-slo-admit"]["throughput_over_request_fcfs"] <= 1.0
    assert sim["modes"]["request-fcfs"]["mean_over_request_fcfs"] == 1.0
    assert 0 < sim["modes"]["step-slo"]["mean_over_request_fcfs"] < 1.5


def test_step_policy_simulator_runs_every_candidate():
    """sim_step_policies.py: each candidate policy on the same seeded arrivals, ratios against request FCFS."""
    import sim_step_policies as sim

    rows = sim.main(["--seeds", "2", "--num-prompts", "12", "--starvation-factors", "1"])
    assert {"request-fcfs", "slo, starvation 1", "SRPT (reference)", "EDF + admission control"} <= set(rows)
    assert all(r.shape == (2, 10) for r in rows.values())
    assert (rows["request-fcfs"][:, 5:] == 1.0).all()  # the baseline against itself
    slo = rows["slo, starvation 1"]
    assert ((slo[:, 2] >= 0) & (slo[:, 2] <= 1)).all() and (slo[:, 8] > 0.9).all()  # attainment; throughput level
