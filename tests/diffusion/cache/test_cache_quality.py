"""Request-scoped cache quality on the real tiny native pipelines (CPU fp32, in this process).

Pins: `quality="lossless"` on a server running a cache backend is bitwise the output of a server without one,
for Qwen-Image, FLUX and Wan; `high` / `fast` reuse exactly the steps their fixed schedules say and change the
output; a step wave (step mode, max_num_seqs=3) holding a lossless, a high, a fast and an adaptive request
gives each exactly (bitwise) what it gets alone; every output says what ran; `--cache-backend cache_dit` runs
cache-dit's DBCache over our blocks in request mode, and its lossless requests stay bitwise uncached.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.diffusion.core.scheduler import DiffusionScheduler
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.diffusion.worker.step_runner import StepWorker
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP
from vllm_omni.models.flux.pipeline import FluxPipeline
from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline
from vllm_omni.models.wan.pipeline import WanPipeline

CPU = torch.device("cpu")
FAMILIES = {"qwen-image": QwenImagePipeline, "flux": FluxPipeline, "wan2.1-t2v": WanPipeline}
STEPS = 5


def load(name: str, **config):
    model_dir = build_tiny(name)
    od_config = OmniDiffusionConfig(model=str(model_dir), **config)
    return FAMILIES[name].from_pretrained(od_config, model_dir, CPU, torch.float32)


@pytest.fixture(scope="module")
def pipes(dist_world):
    """Per family: a pipeline on a server without cache backend and one with `--cache-backend tea_cache`."""
    return {name: (load(name), load(name, cache_backend="tea_cache")) for name in FAMILIES}


@pytest.fixture(scope="module")
def references(pipes):
    """Each family's uncached output of `make(name)`, computed once for the module."""
    out: dict[str, DiffusionOutput] = {}

    def get(name: str) -> DiffusionOutput:
        if name not in out:
            out[name] = run(pipes[name][0], make(name))
        return out[name]

    return get


def make(name: str, rid: str = "r", seed: int = 1, **sp) -> OmniDiffusionRequest:
    size = {"height": 16, "width": 16, "num_frames": 5} if name.startswith("wan") else {"height": 32, "width": 32}
    scale = {"guidance_scale": 3.0} if name.startswith("wan") else {"true_cfg_scale": 2.5}
    params = SP(num_inference_steps=STEPS, seed=seed, output_type="np", **size, **scale, **sp)
    return OmniDiffusionRequest({"prompt": "a cat holding a sign", "negative_prompt": "blurry"}, params, rid)


def run(pipe, request: OmniDiffusionRequest) -> DiffusionOutput:
    out = pipe.forward(DiffusionRequestBatch([request]))[0]
    assert out.error is None, out.error
    return out


def pixels(out: DiffusionOutput) -> np.ndarray:
    value = out.output["video"] if isinstance(out.output, dict) else out.output
    return np.asarray(value)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_lossless_is_bitwise_the_uncached_path_and_presets_cache(pipes, references, name):
    _, cached = pipes[name]
    reference = references(name)
    assert reference.extra["cache"]["backend"] == "none" and reference.extra["cache"]["reused_steps"] == 0
    lossless = run(cached, make(name, quality="lossless"))
    np.testing.assert_array_equal(pixels(lossless), pixels(reference))
    assert lossless.extra["cache"] | {"config": {}} == reference.extra["cache"] | {"config": {}}
    out = run(cached, make(name, quality="high"))  # computes steps 0, 1, 3 (every 2nd after 1) and 4 (last)
    info = out.extra["cache"]
    assert (info["quality"], info["backend"]) == ("high", "tea_cache")
    assert (info["computed_steps"], info["reused_steps"]) == (4, 1)
    num_blocks = info["computed_block_steps"] // info["computed_steps"]
    assert num_blocks >= 2 and info["reused_block_steps"] == num_blocks
    assert not np.array_equal(pixels(out), pixels(reference))


def test_a_server_without_backend_runs_quality_presets_with_tea_cache(pipes):
    plain, cached = pipes["qwen-image"]
    a, b = run(plain, make("qwen-image", quality="high")), run(cached, make("qwen-image", quality="high"))
    assert a.extra["cache"]["backend"] == "tea_cache"
    np.testing.assert_array_equal(pixels(a), pixels(b))
    # The server default ({} = the high preset) serves requests that name no quality.
    default = run(cached, make("qwen-image"))
    assert default.extra["cache"]["quality"] == "default"
    np.testing.assert_array_equal(pixels(default), pixels(b))


class _Runner:
    def __init__(self, pipeline, max_num_seqs: int) -> None:
        self.pipeline = pipeline
        self.od_config = OmniDiffusionConfig(model="tiny", max_num_seqs=max_num_seqs, step_execution=True,
                                             cache_backend="tea_cache")

    def peak_memory_mb(self) -> float:
        return 0.0


def test_a_step_wave_of_mixed_qualities_gives_each_request_its_solo_output(pipes):
    name = "qwen-image"
    _, cached = pipes[name]
    requests = [make(name, "lossless", 1, quality="lossless"), make(name, "high", 2, quality="high"),
                make(name, "fast", 3, quality="fast"),
                make(name, "adaptive", 4, cache_config={"rel_l1_thresh": 0.5, "max_cached_steps": 2})]
    outputs: dict[int, DiffusionOutput] = {}
    runner = _Runner(cached, max_num_seqs=3)
    scheduler, worker = DiffusionScheduler(runner.od_config), StepWorker(runner)  # the engine's and one rank's side

    def run_round() -> None:
        plan = scheduler.schedule()
        for job, out in scheduler.update(plan, worker.execute(plan)):
            outputs[requests.index(job.request)] = out

    for request in requests:
        scheduler.add(request)
    run_round()
    assert len(scheduler.resident) == 3  # lossless, high and fast share every round
    signatures = {worker.states[job.request_id].state.cache.step_signature(2) for job in scheduler.resident}
    assert len(signatures) == 3 and None in signatures  # the co-batching key tells the decisions apart
    for _ in range(4 * STEPS):
        if not scheduler.has_work:
            break
        run_round()
    assert not scheduler.has_work
    for batch_id, request in enumerate(requests):
        out = outputs[batch_id]
        assert out.error is None, out.error
        solo = run(cached, request)
        np.testing.assert_array_equal(pixels(out), pixels(solo))
        assert out.extra["cache"] == solo.extra["cache"]
    assert [outputs[i].extra["cache"]["reused_steps"] for i in range(3)] == [0, 1, 2]  # fast: 0, 1, 4 computed
    assert outputs[3].extra["cache"]["custom"] is True


def test_adaptive_requests_batched_in_request_mode_get_their_solo_output(pipes):
    """An adaptive policy decides from its own rows, so each such request is a group of its own."""
    _, cached = pipes["qwen-image"]
    requests = [make("qwen-image", f"r{i}", seed=i, cache_config={"rel_l1_thresh": 0.5}) for i in range(2)]
    outputs = cached.forward(DiffusionRequestBatch(requests))
    for request, out in zip(requests, outputs, strict=True):
        np.testing.assert_array_equal(pixels(out), pixels(run(cached, request)))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_cache_dit_request_mode(references, name):
    """cache-dit's DBCache over our blocks: high reuses steps, and lossless on the same (hooked) server is still
    bitwise the uncached output."""
    dit = load(name, cache_backend="cache_dit")
    reference = pixels(references(name))
    high = run(dit, make(name, quality="high"))
    info = high.extra["cache"]
    assert (info["backend"], info["quality"]) == ("cache_dit", "high")
    assert info["reused_steps"] >= 1 and info["reused_block_steps"] >= 1
    assert not np.array_equal(pixels(high), reference)
    np.testing.assert_array_equal(pixels(run(dit, make(name, quality="lossless"))), reference)
    if name == "qwen-image":  # a fresh context per request: the same output again after another request
        np.testing.assert_array_equal(pixels(run(dit, make(name, quality="high"))), pixels(high))


def test_cache_dit_frees_the_cuda_graphs(dist_world):
    """On the compiled path, enabling cache-dit frees the DiT's CUDA graphs (they would have captured its
    data-dependent branches) and no forward replays or captures one afterwards (a capture fails on the CPU)."""
    from vllm_omni.diffusion.layers.compile import accelerate_transformer

    dit = load("qwen-image", cache_backend="cache_dit")
    compiled = accelerate_transformer(dit.transformer, compile_blocks=False)
    compiled.runner.graphs["captured"] = object()  # a graph captured before cache-dit was enabled
    out = run(dit, make("qwen-image", quality="high"))
    assert out.extra["cache"]["backend"] == "cache_dit" and out.extra["cache"]["reused_steps"] >= 1
    assert not compiled.runner.graphs and compiled.captures == 0


@pytest.mark.parametrize("backend", ["tea_cache", "cache_dit"])
def test_an_abort_inside_a_cached_group_leaves_the_others_running(pipes, backend):
    """Request mode: dropping a row mid-way drops the group's cache (residuals / cache-dit context hold it)."""
    from vllm_omni.diffusion.step_context import StepContext

    pipe = pipes["qwen-image"][1] if backend == "tea_cache" else load("qwen-image", cache_backend=backend)
    requests = [make("qwen-image", rid, seed, quality="fast") for seed, rid in enumerate(["drop", "keep"])]
    ctx = StepContext(pipe.od_config, request_ids=["drop", "keep"],
                      abort_requested=lambda rid: rid == "drop" and (ctx.step_index or 0) >= 2)
    dropped, kept = pipe.forward(DiffusionRequestBatch(requests), ctx)
    assert dropped.error_status_code == 499
    assert kept.error is None, kept.error
    assert kept.extra["cache"]["backend"] == backend and pixels(kept).shape[0] == 1
