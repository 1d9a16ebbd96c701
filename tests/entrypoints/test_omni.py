"""Offline `Omni` on a diffusion-only model (tiny Qwen-Image through DiffusionEngine, one inline stage).

Pins: one output per prompt in prompt order with images, per-phase stage durations and peak memory; seeds are
honoured; a bad request raises a client error naming the field and leaves the engine usable; close() leaves
no child process and no shared-memory segment.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.entrypoints.leak_checks import shm_segments, wait_until_clean
from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.errors import OmniClientError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def omni():
    shm_before = shm_segments()
    engine = Omni("tiny/qwen-image")
    yield engine
    engine.close()
    assert wait_until_clean(shm_before) == ([], set())


def params(seed: int) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=2, seed=seed)


def test_the_diffusion_stage_reports_its_start_up_phases(omni):
    """Why: each stage's start-up log line (issue 30) says where its seconds went: the core's, then the slowest
    rank's phases."""
    phases = omni.engine.stage_clients[0].startup_phases
    assert list(phases) == ["core process", "core imports", "worker process", "worker imports", "device", "load",
                            "warm-up"]
    assert all(seconds >= 0 for seconds in phases.values()) and phases["core process"] > 0


def test_generate_images_in_prompt_order(omni):
    assert omni.stage_types == ["diffusion"] and omni.output_modalities == {"image"}
    outs = omni.generate(["a cat", "a dog", "a cat"], params(7), use_tqdm=False)
    assert [o.request_id.split("-")[0] for o in outs] == ["0", "1", "2"]
    for out in outs:
        assert out.ok and out.finished and out.final_output_type == "image" and len(out.images) == 1
        assert out.images[0].size == (64, 64)
        assert {"diffusion", "diffusion.denoise", "e2e"} <= set(out.stage_durations)
        assert out.peak_memory_mb > 0
    cat, dog, cat_again = (np.asarray(o.images[0]) for o in outs)
    assert np.array_equal(cat, cat_again) and not np.array_equal(cat, dog)


def test_bad_request_names_field_and_engine_survives(omni):
    with pytest.raises(OmniClientError) as info:
        omni.generate("a cat", [params(0), params(0)])
    assert info.value.param == "sampling_params_list"
    with pytest.raises(OmniClientError) as info:
        omni.generate("a cat", {"num_inference_steps": 2, "colour": "red"})
    assert info.value.param == "colour"
    (out,) = omni.generate("a cat", params(0), use_tqdm=False)
    assert out.ok and len(out.images) == 1
