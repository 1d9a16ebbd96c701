"""Memory admission of diffusion requests by their estimated cost at their shape (issues 13 and 32).

Why it matters: one request at a huge shape (or many outputs) could take the worker's whole memory, and
requests that fit only one at a time ran together. What it pins: the estimate grows with what a request asks
for and is of the right order for a real model; a request that can never fit the stage's budget is a 400
naming the field that makes it too big (in `submit`, before queuing); one that fits only once a running
request finishes waits in the scheduler (oldest first) and then runs; a burst whose estimates add up to more
than the budget completes in either mode (or is refused, request by request) and the worker never dies; the
budget and what is reserved reach each output's stats (/metrics) — on real tiny Qwen-Image workers. On CUDA
the same burst runs on a worker capped with `torch.cuda.set_per_process_memory_fraction`, whose budget is
what the cap leaves free after loading.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from test_diffusion_scheduler import next_batch, request_scheduler

from vllm_omni.catalog.registry import MODEL_REGISTRY
from vllm_omni.catalog.shapes import ShapeRule
from vllm_omni.catalog.spec import ModelSpec
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP
from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline

QWEN_IMAGE = ShapeRule(size_multiple=16, min_size=16, hidden_size=3072, latent_channels=16, vae_channels=96,
                       text_tokens=1024, step_table_width=12 * 60, dtype_bytes=2)
"""Qwen/Qwen-Image's numbers (24 heads x 128, 60 blocks, VAE base_dim 96) in bf16."""
WAN = ShapeRule(size_multiple=16, frame_stride=4, hidden_size=1536, vae_channels=96, default_size=(480, 832),
                default_frames=81, dtype_bytes=2)


def test_estimate_follows_the_request_shape():
    one = QWEN_IMAGE.estimate_bytes(SP(height=1024, width=1024, num_inference_steps=50))
    assert 2 * 2**30 < one < 3 * 2**30  # 1.0 GiB activations + 0.4 GiB step tables + 0.8 GiB VAE decode
    assert QWEN_IMAGE.estimate_bytes(SP(height=1024, width=1024, num_inference_steps=50,
                                        num_outputs_per_prompt=3)) == 3 * one
    assert QWEN_IMAGE.estimate_bytes(SP(height=2048, width=2048, num_inference_steps=50)) > 3 * one
    assert QWEN_IMAGE.estimate_bytes(SP(height=1024, width=1024, num_inference_steps=500)) > one
    assert QWEN_IMAGE.estimate_bytes(SP()) == one  # defaults: 1024², 50 steps
    clip = WAN.estimate_bytes(SP(num_frames=81))
    assert WAN.estimate_bytes(SP()) == clip and WAN.estimate_bytes(SP(num_frames=161)) > 1.5 * clip
    assert ShapeRule().estimate_bytes(SP()) == 0  # no facts: no estimate


def test_a_measured_size_is_predicted_from_its_measurement():
    """At a size warm-up measured (2 steps), a default request is that peak plus the model's per-step tables for
    its other step count, per output; explicit guidance, other frames and unmeasured sizes fall back to the
    model."""
    peak = 123 * 2**20
    rule = dataclasses.replace(QWEN_IMAGE, measured_peaks=((1024, 1024, peak),), measured_steps=2)
    tables = QWEN_IMAGE.modelled_bytes(SP(height=1024, width=1024, num_inference_steps=50)) - \
        QWEN_IMAGE.modelled_bytes(SP(height=1024, width=1024, num_inference_steps=2))
    assert tables == 48 * 2 * 12 * 60 * 3072 * 2
    assert rule.estimate_bytes(SP(height=1024, width=1024, num_inference_steps=2)) == peak
    assert rule.estimate_bytes(SP()) == peak + tables  # the default size, 50 steps
    assert rule.estimate_bytes(SP(num_outputs_per_prompt=3)) == 3 * (peak + tables)
    for sp in (SP(height=512, width=512), SP(true_cfg_scale=7.0), SP(guidance_scale=2.0)):
        assert rule.estimate_bytes(sp) == QWEN_IMAGE.modelled_bytes(sp) == QWEN_IMAGE.estimate_bytes(sp)
    video = dataclasses.replace(WAN, measured_peaks=((480, 832, peak),))
    assert video.estimate_bytes(SP(num_frames=81)) == peak + 0  # Wan has no step tables
    assert video.estimate_bytes(SP(num_frames=161)) == WAN.modelled_bytes(SP(num_frames=161))


@pytest.mark.parametrize("params,param", [
    ({"num_outputs_per_prompt": 8}, "num_outputs_per_prompt"),
    ({"num_frames": 1001}, "num_frames"),
    ({"num_inference_steps": 100_000}, "num_inference_steps"),
    ({"height": 2048, "width": 2048}, "size"),
])
def test_never_fits_names_the_field(params, param):
    budget = int(1.2 * WAN.estimate_bytes(SP(height=480, width=832, num_frames=81, num_inference_steps=50)))
    rule = dataclasses.replace(WAN, memory_budget_bytes=budget, step_table_width=64)
    sp = SP(height=480, width=832, num_frames=81, num_inference_steps=50)
    rule.check(sp, size_field="size")
    with pytest.raises(OmniClientError) as err:
        rule.check(dataclasses.replace(sp, **params), "sampling_params_list[0].", size_field="size")
    assert err.value.param == f"sampling_params_list[0].{param}" and "GiB" in err.value.message


def test_scheduler_trims_the_batch_to_what_fits():
    scheduler = request_scheduler(max_num_seqs=4)
    for i in range(3):
        scheduler.add(OmniDiffusionRequest("x", SP(), f"r{i}"), now=0.0)
    batch, _ = next_batch(scheduler, now=1.0, fits=lambda rs: len(rs) <= 2)
    assert [r.request_id for r in batch] == ["r0", "r1"] and scheduler.num_waiting == 1


BUDGET_GB = 16 / 1024
"""Tiny Qwen-Image at 32², one output: ~8.5 MB + 12 KB per step. A 60-step and a 2-step request (9.2 + 8.6
MB) do not fit 16 MB together; each fits alone; 4 outputs (~34 MB) never fit."""


@pytest.fixture(scope="module")
def engine():
    engine = DiffusionEngine(OmniDiffusionConfig(model="tiny/qwen-image", step_execution=True, max_num_seqs=4,
                                                 diffusion_memory_budget_gb=BUDGET_GB))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def request_engine():
    """Request mode, where without the budget the burst below would co-batch 4 at a time."""
    engine = DiffusionEngine(OmniDiffusionConfig(model="tiny/qwen-image", max_num_seqs=4,
                                                 diffusion_memory_budget_gb=BUDGET_GB))
    yield engine
    engine.close()


def make(rid: str, steps: int, **kwargs) -> OmniDiffusionRequest:
    return OmniDiffusionRequest("a cat", SP(height=32, width=32, num_inference_steps=steps, seed=0,
                                            output_type="np", **kwargs), rid)


def test_budget_from_the_flag(engine):
    assert engine.shape_rule.memory_budget_bytes == 16 * 2**20 and engine.shape_rule.dtype_bytes == 4


def test_never_fitting_request_refused_at_submit(engine):
    with pytest.raises(OmniClientError) as err:
        engine.submit(make("big", 2, num_outputs_per_prompt=4))
    assert err.value.param == "num_outputs_per_prompt"
    assert engine.stats()["num_waiting"] == 0


def test_request_that_fits_later_waits_then_runs(engine):
    first_step = threading.Event()
    long = engine.submit(make("long", 60), on_partial=lambda p: first_step.set())
    assert first_step.wait(120)
    short = engine.submit(make("short", 2))
    # Without the budget, step mode admits it at the next step and it finishes while the long one runs.
    short_out = short.result(300)
    assert long.done(), "the short request ran beside the long one although both do not fit the budget"
    assert long.result().error is None and short_out.error is None
    assert short_out.stage_durations["queue"] > 0.0


def run_burst(engine: DiffusionEngine, tag: str, shape: dict) -> list:
    """Six requests at once, one of which can never fit (a 400 naming `num_outputs_per_prompt`); the other five
    add up to more than the budget. Returns their outputs, after checking that each completed, the memory
    reserved beside each never left room for less than its own estimate, and the worker is alive."""
    def request(rid: str, **extra) -> OmniDiffusionRequest:
        sp = {"height": 32, "width": 32, "num_inference_steps": 2, "seed": 0, "output_type": "np", **shape, **extra}
        return OmniDiffusionRequest("a cat", SP(**sp), rid)

    before = engine.stats()
    with pytest.raises(OmniClientError) as err:
        engine.submit(request(f"{tag}-never", num_outputs_per_prompt=8))
    assert err.value.param == "num_outputs_per_prompt"
    requests = [request(f"{tag}-{i}") for i in range(5)]
    budget = engine.shape_rule.memory_budget_bytes
    need = engine.shape_rule.estimate_bytes(requests[0].sampling_params)
    assert 5 * need > budget >= need
    futures = [engine.submit(request) for request in requests]
    outputs = [future.result(600) for future in futures]
    assert [out.error for out in outputs] == [None] * 5
    for out in outputs:
        assert out.step_stats.budget_bytes == budget
        assert out.step_stats.reserved_bytes + need <= budget
    stats = engine.stats()
    assert stats["num_restarts"] == before["num_restarts"] and not stats["is_dead"]
    assert stats["memory_reserved_bytes"] == 0 and stats["memory_budget_bytes"] == budget
    return outputs


@pytest.mark.parametrize("mode", ["step", "request"])
def test_a_burst_over_the_budget_completes_or_is_refused(mode, engine, request_engine):
    engine = engine if mode == "step" else request_engine
    before = engine.stats()["batch_sizes"]
    run_burst(engine, mode, {})
    if mode == "request":  # one at a time although max_num_seqs=4 and all five share a batch key
        after = engine.stats()["batch_sizes"]
        assert after.get(1, 0) - before.get(1, 0) == 5 and max(after) == 1


CUDA_CAP_BYTES = 2 * 2**30


class CappedQwenImagePipeline(QwenImagePipeline):
    """Tiny Qwen-Image whose worker process may allocate at most `CUDA_CAP_BYTES` (a small card)."""

    @classmethod
    def from_pretrained(cls, od_config, model_dir, device, dtype):
        torch.cuda.set_per_process_memory_fraction(CUDA_CAP_BYTES / torch.cuda.mem_get_info(device)[1], device)
        return super().from_pretrained(od_config, model_dir, device, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("step_execution", [True, False])
def test_a_burst_on_a_capped_gpu_never_runs_out_of_memory(step_execution):
    qwen = next(spec for spec in MODEL_REGISTRY.specs() if "QwenImagePipeline" in spec.diffusion_pipelines)
    entry = dataclasses.replace(qwen.diffusion_pipelines["QwenImagePipeline"],
                                target=f"{__name__}:CappedQwenImagePipeline")
    MODEL_REGISTRY.register_family(ModelSpec(family="capped-qwen-image", description="tiny Qwen-Image, capped",
                                             diffusion_pipelines={"CappedQwenImagePipeline": entry}))
    engine = DiffusionEngine(OmniDiffusionConfig(model="tiny/qwen-image", model_class_name="CappedQwenImagePipeline",
                                                 step_execution=step_execution, max_num_seqs=4, enforce_eager=True))
    try:
        budget = engine.shape_rule.memory_budget_bytes
        assert 0 < budget < CUDA_CAP_BYTES  # what the cap leaves after the weights, not the H200's free memory
        side = 16 * round((budget / 3 / engine.shape_rule.estimate_bytes(SP(height=1024, width=1024,
                                                                              num_inference_steps=2))) ** 0.5 * 64)
        side = min(max(side, 64), 4096)  # each request's estimate about a third of the budget: 5 never fit at once
        outputs = run_burst(engine, f"cuda-{step_execution}", {"height": side, "width": side})
        assert all(out.peak_memory_mb * 2**20 <= CUDA_CAP_BYTES for out in outputs)
    finally:
        engine.close()


@pytest.mark.cuda
def test_warmup_measures_each_size_and_predicts_its_peak_within_10_percent():
    """Compiled tiny Qwen-Image on CUDA warmed at 3 sizes: the worker measured each size's peak, admission
    predicts a served request there from it (50 steps: the measurement plus the step tables), and the request's
    measured peak beyond what the idle worker holds is within 10% of the prediction."""
    sizes = [(256, 256), (512, 512), (768, 512)]
    engine = DiffusionEngine(OmniDiffusionConfig(model="tiny/qwen-image", device="cuda",
                                                 diffusion_warmup_shapes=",".join(f"{w}x{h}" for w, h in sizes)))
    try:
        rule = engine.shape_rule
        assert {(h, w) for h, w, _ in rule.measured_peaks} == {(h, w) for w, h in sizes}
        idle = max(info["allocated_bytes"] for info in engine.executor.worker_info)
        for width, height in sizes:
            sp = SP(height=height, width=width, num_inference_steps=50, seed=0, output_type="np")
            predicted = rule.estimate_bytes(sp)
            assert predicted != rule.modelled_bytes(sp)
            out = engine.submit(OmniDiffusionRequest({"prompt": "a cat", "negative_prompt": "dog"}, sp,
                                                     f"peak-{width}x{height}")).result(300)
            assert out.error is None, out.error
            measured = out.peak_memory_mb * 2**20 - idle
            assert abs(predicted - measured) <= 0.10 * measured, (width, height, predicted, measured)
    finally:
        engine.close()
