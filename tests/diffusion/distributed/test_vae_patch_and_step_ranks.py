"""Two gloo ranks, one spawn: VAE patch-parallel decode and step mode on several ranks.

VAE patch parallel. What it pins: random latents tall enough that each strip plus its halo is smaller than the
frame (so the test sees real strips, not two whole decodes) decode equal to `vae.decode` (Qwen-Image, Wan2.1,
Wan2.2's patchified residual VAE, several frames for Wan); the tiny pipelines end to end with
`vae_patch_parallel_size=2` alone and on the ranks of Ulysses 2 or CFG 2 give the single-rank output (PSNR >= 60
dB, fp32); a degree that does not fit the other degrees fails naming the flag.

Step mode (Ulysses 2, CFG 2; rank 0 decides every round, the other rank follows). What it pins: two tiny
Qwen-Image requests (true CFG) admitted at different steps, reaching the two ranks at different rounds (rank 1
must read the second one early when rank 0 steps it), give their single-rank request-mode outputs (PSNR >= 60
dB, fp32) on both ranks, which ran the same number of rounds; an abort that lands on rank 1 rounds before it
lands on rank 0 ends the aborted request on both ranks at rank 0's round, and the other request's output is
untouched; nothing hangs.
"""

from __future__ import annotations

import pytest
from parallel_harness import run_jobs
from parallel_jobs import psnr, run_pipeline
from step_rank_jobs import run_step_script
from vae_patch_jobs import as_array, decode_latents

from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
from vllm_omni.diffusion.distributed.parallel_state import group_ranks
from vllm_omni.errors import OmniClientError

DECODES = {  # (tiny checkpoint, latent shape): 28 latent rows, a strip of 14 + the halo (12) < 28
    "qwen-image": ("qwen-image", (1, 16, 1, 28, 4)),
    "wan2.1": ("wan2.1-t2v", (1, 16, 2, 28, 4)),
    "wan2.2-ti2v": ("wan2.2-ti2v-5b", (1, 48, 2, 28, 4)),
}
PIPELINE_LAYOUTS = {
    "vae2": {"vae_patch_parallel_size": 2},
    "vae2_ulysses2": {"vae_patch_parallel_size": 2, "ulysses_degree": 2},
    "vae2_cfg2": {"vae_patch_parallel_size": 2, "cfg_parallel_size": 2},
}
PIPELINE_CASES = {"qwen-image": ("vae2", "vae2_ulysses2"), "wan2.1-t2v": ("vae2_cfg2",)}
"""The layouts each pipeline runs (the decode cases above already cover each VAE alone)."""
PIPELINES = {
    "qwen-image": ({"prompt": "a red cube", "negative_prompt": "blurry"},
                   dict(height=64, width=64, num_inference_steps=2, seed=0, true_cfg_scale=4.0, output_type="np")),
    "wan2.1-t2v": ({"prompt": "a cat walks", "negative_prompt": "blurry"},
                   dict(height=32, width=32, num_frames=5, num_inference_steps=2, seed=0, max_sequence_length=16)),
}

STEP_LAYOUTS = {"ulysses2": {"ulysses_degree": 2}, "cfg2": {"cfg_parallel_size": 2}}
STEP_REQUESTS = {
    "a": ({"prompt": "a red cube", "negative_prompt": "blurry"},
          dict(height=64, width=64, num_inference_steps=4, seed=1, true_cfg_scale=4.0, output_type="np")),
    "b": ({"prompt": "a blue sphere on grass", "negative_prompt": "dark"},
          dict(height=64, width=64, num_inference_steps=4, seed=2, true_cfg_scale=4.0, output_type="np")),
}
STEP_SCRIPTS = {  # (arrivals, aborts): rank -> request -> the rank's local round
    "staggered": ({0: {"a": 0, "b": 2}, 1: {"a": 0, "b": 6}}, {}),
    "abort_b": ({0: {"a": 0, "b": 1}, 1: {"a": 0, "b": 1}}, {0: {"b": 3}, 1: {"b": 1}}),
}


@pytest.fixture(scope="module")
def results():
    from vllm_omni.catalog.tiny import build_tiny

    dirs = {name: str(build_tiny(name)) for name in {*PIPELINES, *(m for m, _ in DECODES.values())}}
    jobs, keys = [], []
    for case, (model, shape) in DECODES.items():
        for layout, parallel in (("single", {}), ("vae2", {"vae_patch_parallel_size": 2})):
            jobs.append((parallel, decode_latents, (dirs[model], shape, 0)))
            keys.append(("decode", case, layout))
    for model, (prompt, params) in PIPELINES.items():
        for layout in ("single", *PIPELINE_CASES[model]):
            parallel = PIPELINE_LAYOUTS.get(layout, {})
            jobs.append((parallel, run_pipeline, (dirs[model], parallel, prompt, params)))
            keys.append(("pipeline", model, layout))
    for rid, (prompt, params) in STEP_REQUESTS.items():
        jobs.append(({}, run_pipeline, (dirs["qwen-image"], {}, prompt, params)))
        keys.append(("request_mode", rid))
    for layout, parallel in STEP_LAYOUTS.items():
        for script, (arrivals, aborts) in STEP_SCRIPTS.items():
            jobs.append((parallel, run_step_script, (dirs["qwen-image"], parallel, STEP_REQUESTS, arrivals, aborts)))
            keys.append(("step", layout, script))
    return dict(zip(keys, run_jobs(jobs), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DECODES))
def test_strip_decode_equals_whole_decode(results, case):
    want, got = results[("decode", case, "single")], results[("decode", case, "vae2")]
    assert got["strip_rows"] + got["halo"] < got["latent_rows"], "a strip and its halo must be smaller than the frame"
    assert want["output"].shape == got["output"].shape and want["output"].std() > 0
    assert psnr(as_array(got), as_array(want)) >= 60.0


@pytest.mark.slow
@pytest.mark.parametrize(("model", "layout"), [(m, lay) for m, cases in PIPELINE_CASES.items() for lay in cases])
def test_pipeline_with_vae_patch_matches_single_rank(results, model, layout):
    want, got = results[("pipeline", model, "single")], results[("pipeline", model, layout)]
    assert want["output"].std() > 0
    assert psnr(got["output"], want["output"]) >= 60.0


def test_vae_patch_degree_reuses_or_extends_the_ranks():
    assert DiffusionParallelConfig(vae_patch_parallel_size=2, ulysses_degree=2).world_size == 2
    assert DiffusionParallelConfig(vae_patch_parallel_size=2, cfg_parallel_size=2, ulysses_degree=2).world_size == 4
    assert DiffusionParallelConfig(vae_patch_parallel_size=4, cfg_parallel_size=2).world_size == 4
    ranks = group_ranks(DiffusionParallelConfig(vae_patch_parallel_size=4, cfg_parallel_size=2))
    assert ranks["vae"] == [[0, 1, 2, 3]] and ranks["cfg"] == [[0, 1], [2, 3]]
    assert group_ranks(DiffusionParallelConfig(vae_patch_parallel_size=2, ulysses_degree=4))["vae"] == [
        [0, 1], [2, 3]]
    for bad in ({"vae_patch_parallel_size": 3, "ulysses_degree": 2}, {"vae_patch_parallel_size": 0}):
        with pytest.raises(OmniClientError, match="--vae-patch-parallel-size") as info:
            DiffusionParallelConfig(**bad)
        assert info.value.param == "vae_patch_parallel_size"


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(STEP_LAYOUTS))
def test_step_mode_staggered_requests_equal_request_mode_on_every_rank(results, layout):
    ranks = results[("step", layout, "staggered")]
    assert ranks[0]["rounds"] == ranks[1]["rounds"] >= 5  # b joined a round after a started
    assert [rank["broadcasts"] for rank in ranks] == [0, 0]
    for rank in ranks:
        for rid in STEP_REQUESTS:
            want = results[("request_mode", rid)]["output"]
            assert want.std() > 0
            assert psnr(rank["outputs"][rid], want) >= 60.0, (rid, rank)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(STEP_LAYOUTS))
def test_step_mode_abort_follows_rank_0_and_leaves_the_other_request_intact(results, layout):
    ranks = results[("step", layout, "abort_b")]
    assert ranks[0]["rounds"] == ranks[1]["rounds"]
    for rank in ranks:
        assert rank["outputs"]["b"] == "aborted"
        assert psnr(rank["outputs"]["a"], results[("request_mode", "a")]["output"]) >= 60.0


def test_step_execution_accepts_parallel_ranks():
    config = OmniDiffusionConfig.from_kwargs(model="tiny/qwen-image", step_execution=True, ulysses_degree=2,
                                             cfg_parallel_size=2)
    assert config.parallel_config.world_size == 4
