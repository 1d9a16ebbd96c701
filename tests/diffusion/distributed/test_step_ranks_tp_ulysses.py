"""Step mode on two gloo ranks with tensor parallel 2 and Ulysses 2: a step batch whose composition changes
mid-flight is sharded as in request mode.

What it pins: three tiny Qwen-Image requests (true CFG) on a worker that keeps up to three resident states
sharing one transformer forward per round: `a` (4 steps) and `c` (2 steps) start together, `b` (4 steps)
joins at the engine's round 1 (both ranks get it in that round's plan), and `c` leaves after round 2 while `a`
and `b` go on. Every request's output on both ranks equals its single-rank request-mode output (PSNR >= 60 dB,
fp32), both ranks run the same rounds, and neither makes an object broadcast. (Ulysses 2 and CFG 2 with
staggered arrivals and aborts: test_vae_patch_and_step_ranks.py.)
"""

from __future__ import annotations

import pytest
from parallel_harness import run_jobs
from parallel_jobs import psnr, run_pipeline
from step_rank_jobs import run_step_script

LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "ulysses2": {"ulysses_degree": 2}}
PARAMS = dict(height=64, width=64, seed=1, true_cfg_scale=4.0, output_type="np")
REQUESTS = {
    "a": ({"prompt": "a red cube", "negative_prompt": "blurry"}, {**PARAMS, "num_inference_steps": 4}),
    "c": ({"prompt": "a green cone", "negative_prompt": "noisy"}, {**PARAMS, "num_inference_steps": 2, "seed": 3}),
    "b": ({"prompt": "a blue sphere on grass", "negative_prompt": "dark"},
          {**PARAMS, "num_inference_steps": 4, "seed": 2}),
}
ARRIVALS = {0: {"a": 0, "c": 0, "b": 1}, 1: {"a": 0, "c": 0, "b": 3}}


@pytest.fixture(scope="module")
def results():
    from vllm_omni.catalog.tiny import build_tiny

    model = str(build_tiny("qwen-image"))
    jobs = [({}, run_pipeline, (model, {}, prompt, params)) for prompt, params in REQUESTS.values()]
    jobs += [(parallel, run_step_script, (model, parallel, REQUESTS, ARRIVALS, {}, 50, 3))
             for parallel in LAYOUTS.values()]
    outputs = run_jobs(jobs)
    return dict(zip(REQUESTS, outputs[:len(REQUESTS)], strict=True)), dict(
        zip(LAYOUTS, outputs[len(REQUESTS):], strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_step_batch_that_changes_mid_flight_equals_request_mode_on_every_rank(results, layout):
    request_mode, step_mode = results
    ranks = step_mode[layout]
    assert ranks[0]["rounds"] == ranks[1]["rounds"] == 5  # b joins at round 1 and takes 4 steps
    assert [rank["broadcasts"] for rank in ranks] == [0, 0]  # every rank executes the plan: no rank decides
    for rank in ranks:
        for rid in REQUESTS:
            want = request_mode[rid]["output"]
            assert want.std() > 0
            assert psnr(rank["outputs"][rid], want) >= 60.0, (layout, rid)
