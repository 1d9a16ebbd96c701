"""Step execution (`StepExecutor`) on real tiny pipelines in this process (CPU fp32), then through real workers.

Pins: a request that arrives while another runs is admitted at the next step boundary and finishes long before
the long one; requests with different step counts, seeds and CFG on/off share rounds, joining and leaving
mid-flight (co-batched into one transformer forward per step where their shapes agree), and each ends with
exactly (bitwise, on CPU fp32) the output it gets alone in request mode; at most `max_num_seqs` states are
resident; an abort leaves at the next step boundary and frees its state; a request that raises inside a step
(injected fault) or fails validation is retired alone with its error while the others are bitwise unaffected.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from step_harness import Harness
from step_pipelines import FaultyFluxPipeline, FaultyQwenImagePipeline

from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

CPU = torch.device("cpu")
PIPELINES = {"qwen-image": FaultyQwenImagePipeline, "flux": FaultyFluxPipeline}


@pytest.fixture(scope="module")
def pipes(dist_world):
    out = {}
    for name, cls in PIPELINES.items():
        model_dir = build_tiny(name)
        out[name] = cls.from_pretrained(OmniDiffusionConfig(model=str(model_dir)), model_dir, CPU, torch.float32)
    return out


def make(name: str, rid: str, steps: int, seed: int, prompt: str = "a cat holding a sign", cfg: bool = True,
         size: int = 32) -> OmniDiffusionRequest:
    data = {"prompt": prompt, **({"negative_prompt": "blurry"} if cfg else {})}
    scale = {"true_cfg_scale": 2.5 if name == "flux" else 4.0} if cfg else {}
    sp = SP(height=size, width=size, num_inference_steps=steps, seed=seed, output_type="np", **scale)
    return OmniDiffusionRequest(data, sp, rid)


def solo(pipe, request: OmniDiffusionRequest) -> np.ndarray:
    out = pipe.forward(DiffusionRequestBatch([request]))[0]
    assert out.error is None
    return np.asarray(out.output)


def assert_solo(pipe, harness: Harness, request: OmniDiffusionRequest) -> None:
    out = harness.outputs[request.request_id]
    assert out.error is None, out.error
    np.testing.assert_array_equal(np.asarray(out.output), solo(pipe, request))


@pytest.mark.parametrize("name", list(PIPELINES))
def test_joiners_and_leavers_match_solo_bitwise(pipes, name):
    pipe = pipes[name]
    harness = Harness(pipe, max_num_seqs=2)
    a = make(name, "a", steps=5, seed=1)
    b = make(name, "b", steps=2, seed=2, prompt="a red car at night", cfg=False)
    c = make(name, "c", steps=3, seed=3, prompt="mountains and a lake", size=64)
    harness.add(a)
    harness.round()
    harness.add(b)  # joins at the next boundary
    harness.add(c)  # waits: two states are resident
    harness.round()
    assert len(harness.executor.resident) == 2 and len(harness.executor.waiting) == 1
    harness.drain()
    assert harness.finished_at["b"] < harness.finished_at["a"]  # the short one left mid-flight
    assert harness.finished_at["b"] < harness.finished_at["c"]  # c took b's place
    for request in (a, b, c):
        assert_solo(pipe, harness, request)


def test_a_late_request_starts_at_the_next_step(pipes):
    pipe = pipes["qwen-image"]
    harness = Harness(pipe)
    harness.add(make("qwen-image", "long", steps=12, seed=1, cfg=False))
    for _ in range(3):
        harness.round()
    submitted = time.perf_counter()
    harness.add(make("qwen-image", "short", steps=2, seed=2, cfg=False))
    harness.round()  # admitted and first step
    harness.round()  # second step, decoded, sent
    lifetime = time.perf_counter() - submitted
    assert harness.finished_at == {"short": 5}
    assert harness.executor.resident[0].state.step_index == 5
    assert 0 < harness.outputs["short"].stage_durations["step_admission_wait"] < lifetime
    harness.drain()
    assert harness.finished_at["long"] == 12


def test_abort_leaves_at_the_next_step_and_frees_its_state(pipes):
    pipe = pipes["qwen-image"]
    harness = Harness(pipe)
    keep = make("qwen-image", "keep", steps=4, seed=1)
    harness.add(make("qwen-image", "gone", steps=50, seed=2))
    harness.add(keep)
    harness.round()
    harness.abort("gone")
    harness.round()
    assert harness.outputs["gone"].error_status_code == 499
    assert [job.request.request_id for job in harness.executor.resident] == ["keep"]
    harness.drain()
    assert_solo(pipe, harness, keep)
    assert not harness.aborts.pairs  # forgotten once every batch finished


def test_waiting_request_aborted_before_admission_never_runs(pipes):
    harness = Harness(pipes["qwen-image"], max_num_seqs=1)
    harness.add(make("qwen-image", "first", steps=2, seed=1, cfg=False))
    harness.add(make("qwen-image", "queued", steps=2, seed=2, cfg=False))
    harness.abort("queued")
    harness.drain()
    assert harness.outputs["queued"].error_status_code == 499 and harness.outputs["first"].error is None
    assert harness.rounds == 2


@pytest.mark.parametrize("name", list(PIPELINES))
def test_a_failing_request_is_retired_alone(pipes, name):
    pipe = pipes[name]
    harness = Harness(pipe)
    others = [make(name, "x", steps=3, seed=1), make(name, "y", steps=4, seed=2, cfg=False)]
    harness.add(others[0])
    harness.add(make(name, "bad", steps=4, seed=3, prompt="FAIL here"))
    harness.add(others[1])
    harness.round()
    harness.round()  # step 1 of "bad" raises
    assert "injected fault" in harness.outputs["bad"].error and harness.outputs["bad"].error_status_code == 500
    assert len(harness.executor.resident) == 2
    harness.drain()
    for request in others:
        assert_solo(pipe, harness, request)


def test_an_invalid_request_fails_alone_at_admission(pipes):
    pipe = pipes["qwen-image"]
    harness = Harness(pipe)
    good = make("qwen-image", "good", steps=2, seed=1)
    harness.add(make("qwen-image", "empty", steps=2, seed=2, prompt="  "))
    harness.add(good)
    harness.round()
    assert harness.outputs["empty"].error_status_code == 400 and "prompt" in harness.outputs["empty"].error
    harness.drain()
    assert_solo(pipe, harness, good)


def test_resident_states_fail_clearly_while_the_worker_sleeps(pipes):
    harness = Harness(pipes["qwen-image"])
    harness.add(make("qwen-image", "r", steps=3, seed=1, cfg=False))
    harness.round()
    harness.executor.runner.pipeline = None  # what sleep(level=2) leaves
    harness.add(make("qwen-image", "late", steps=2, seed=2, cfg=False))
    harness.drain()
    for rid in ("r", "late"):
        assert "asleep" in harness.outputs[rid].error
