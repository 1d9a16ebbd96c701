"""Step mode on 2 gloo ranks (Ulysses 2, CFG 2): rank 0 decides every round, the other rank follows.

What it pins: two tiny Qwen-Image requests (true CFG) admitted at different steps, reaching the two ranks at
different rounds (rank 1 must read the second one early when rank 0 steps it), give their single-rank
request-mode outputs (PSNR >= 60 dB, fp32) on both ranks, which ran the same number of rounds; an abort that
lands on rank 1 rounds before it lands on rank 0 ends the aborted request on both ranks at rank 0's round, and the
other request's output is untouched; nothing hangs. One spawn of 2 ranks runs every job.
"""

from __future__ import annotations

import pytest
from parallel_harness import run_jobs
from parallel_jobs import psnr, run_pipeline
from step_rank_jobs import run_step_script

from vllm_omni.diffusion.data import OmniDiffusionConfig

LAYOUTS = {"ulysses2": {"ulysses_degree": 2}, "cfg2": {"cfg_parallel_size": 2}}
REQUESTS = {
    "a": ({"prompt": "a red cube", "negative_prompt": "blurry"},
          dict(height=64, width=64, num_inference_steps=4, seed=1, true_cfg_scale=4.0, output_type="np")),
    "b": ({"prompt": "a blue sphere on grass", "negative_prompt": "dark"},
          dict(height=64, width=64, num_inference_steps=4, seed=2, true_cfg_scale=4.0, output_type="np")),
}
SCRIPTS = {  # (arrivals, aborts): rank -> request -> the rank's local round
    "staggered": ({0: {"a": 0, "b": 2}, 1: {"a": 0, "b": 6}}, {}),
    "abort_b": ({0: {"a": 0, "b": 1}, 1: {"a": 0, "b": 1}}, {0: {"b": 3}, 1: {"b": 1}}),
}


@pytest.fixture(scope="module")
def results():
    from vllm_omni.models.tiny import build_tiny

    model_dir = str(build_tiny("qwen-image"))
    jobs, keys = [], []
    for rid, (prompt, params) in REQUESTS.items():
        jobs.append(({}, run_pipeline, (model_dir, {}, prompt, params)))
        keys.append(("request_mode", rid))
    for layout, parallel in LAYOUTS.items():
        for script, (arrivals, aborts) in SCRIPTS.items():
            jobs.append((parallel, run_step_script, (model_dir, parallel, REQUESTS, arrivals, aborts)))
            keys.append((layout, script))
    return dict(zip(keys, run_jobs(jobs), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_staggered_requests_equal_request_mode_on_every_rank(results, layout):
    ranks = results[(layout, "staggered")]
    assert ranks[0]["rounds"] == ranks[1]["rounds"] >= 5  # b joined a round after a started
    for rank in ranks:
        for rid in REQUESTS:
            want = results[("request_mode", rid)]["output"]
            assert want.std() > 0
            assert psnr(rank["outputs"][rid], want) >= 60.0, (rid, rank)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_abort_follows_rank_0_and_leaves_the_other_request_intact(results, layout):
    ranks = results[(layout, "abort_b")]
    assert ranks[0]["rounds"] == ranks[1]["rounds"]
    for rank in ranks:
        assert rank["outputs"]["b"] == "aborted"
        assert psnr(rank["outputs"]["a"], results[("request_mode", "a")]["output"]) >= 60.0


def test_step_execution_accepts_parallel_ranks():
    config = OmniDiffusionConfig.from_kwargs(model="tiny/qwen-image", step_execution=True, ulysses_degree=2,
                                             cfg_parallel_size=2)
    assert config.parallel_config.world_size == 4
