"""Request-batch scheduling policy, driven with an explicit clock.

What it pins: requests with equal sampling-params keys co-batch (different seeds included) up to
max_num_seqs, and so do requests with different LoRA adapters (each row runs its own); different size, steps,
CFG, negative-prompt presence or quality (None vs "lossless" too) never co-batch; an unfilled batch waits at
most request_batch_max_wait_ms; FIFO across keys; abort.
"""

from __future__ import annotations

import pytest

from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched import RequestScheduler, build_request_batch_sampling_params_key
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP


def req(rid: str, prompt="a cat", **sp) -> OmniDiffusionRequest:
    return OmniDiffusionRequest(prompt, SP(**sp), rid)


def ids(batch) -> list[str]:
    return [r.request_id for r in batch]


def test_different_seeds_and_prompts_share_a_key():
    a = build_request_batch_sampling_params_key(req("a", "x", seed=1))
    b = build_request_batch_sampling_params_key(req("b", "y", seed=2))
    assert a == b


def test_different_loras_share_a_key():
    loras = [None, {"name": "a"}, {"name": "b", "scale": 0.5}, [{"name": "a"}, {"path": "/b"}]]
    keys = {build_request_batch_sampling_params_key(req(str(i), lora=lora)) for i, lora in enumerate(loras)}
    assert len(keys) == 1


@pytest.mark.parametrize(
    "a, b",
    [
        ({"height": 64}, {"height": 128}),
        ({"num_inference_steps": 4}, {"num_inference_steps": 8}),
        ({"true_cfg_scale": 4.0}, {"true_cfg_scale": 1.0}),
        ({"quality": "high"}, {"quality": "lossless"}),
        ({}, {"quality": "lossless"}),
        ({"negative_prompt": "blurry"}, {}),
        ({"extra_args": {"task": "t2v"}}, {"extra_args": {"task": "i2v"}}),
    ],
)
def test_incompatible_params_have_different_keys(a, b):
    assert build_request_batch_sampling_params_key(req("a", **a)) != build_request_batch_sampling_params_key(
        req("b", **b)
    )


def test_full_batch_is_dispatched_without_waiting():
    sched = RequestScheduler(max_num_seqs=2, request_batch_max_wait_ms=1000)
    for i in range(3):
        sched.add_request(req(f"r{i}", seed=i), now=0.0)
    batch, wait = sched.schedule(now=0.0)
    assert ids(batch) == ["r0", "r1"] and wait is None
    assert sched.num_waiting == 1


def test_partial_batch_waits_at_most_max_wait():
    sched = RequestScheduler(max_num_seqs=4, request_batch_max_wait_ms=100)
    sched.add_request(req("r0"), now=10.0)
    batch, wait = sched.schedule(now=10.03)
    assert batch == [] and wait == pytest.approx(0.07)
    sched.add_request(req("r1"), now=10.05)
    batch, _ = sched.schedule(now=10.1)
    assert ids(batch) == ["r0", "r1"]


def test_zero_wait_dispatches_immediately():
    sched = RequestScheduler(max_num_seqs=8)
    sched.add_request(req("r0"), now=0.0)
    assert ids(sched.schedule(now=0.0)[0]) == ["r0"]


def test_oldest_request_picks_the_key_and_others_keep_order():
    sched = RequestScheduler(max_num_seqs=4)
    sched.add_request(req("big0", height=128), now=0.0)
    sched.add_request(req("small0", height=64), now=0.1)
    sched.add_request(req("big1", height=128), now=0.2)
    sched.add_request(req("small1", height=64), now=0.3)
    assert ids(sched.schedule(now=1.0)[0]) == ["big0", "big1"]
    assert ids(sched.schedule(now=1.0)[0]) == ["small0", "small1"]
    assert sched.schedule(now=1.0) == ([], None)


def test_abort_and_duplicates():
    sched = RequestScheduler(max_num_seqs=4)
    sched.add_request(req("r0"), now=0.0)
    sched.add_request(req("r1"), now=0.0)
    with pytest.raises(ValueError, match="already waiting"):
        sched.add_request(req("r0"), now=0.0)
    assert ids(sched.abort(["r0", "unknown"])) == ["r0"]
    assert ids(sched.schedule(now=0.0)[0]) == ["r1"]
