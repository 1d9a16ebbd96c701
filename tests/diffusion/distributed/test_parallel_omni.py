"""`Omni(..., ulysses_degree=2)` end to end: two real worker processes, gloo, the image equals one rank's.

What it pins: the degree flags reach the workers through the stage config, the multiproc executor starts
ulysses x ring x cfg x tp ranks, the groups come up in real workers, the request's image equals the single-rank
pipeline's (run in this process), and close() leaves no worker behind.
"""

from __future__ import annotations

import os

import numpy as np
import psutil
import pytest
from parallel_jobs import psnr, run_pipeline

from tests.entrypoints.leak_checks import multiprocessing_helper

PARAMS = dict(height=64, width=64, num_inference_steps=2, seed=3, true_cfg_scale=4.0, negative_prompt="blurry")


@pytest.mark.slow
def test_omni_ulysses2_image_equals_single_rank(dist_world):
    from vllm_omni import Omni, OmniDiffusionSamplingParams
    from vllm_omni.catalog.tiny import build_tiny

    prompt = "a red cube"
    want = run_pipeline(str(build_tiny("qwen-image")), {}, prompt, PARAMS)["output"][0]
    omni = Omni(model="tiny/qwen-image", ulysses_degree=2)
    try:
        children = [p for p in psutil.Process().children(recursive=True) if _engine_process(p)]
        (out,) = omni.generate([prompt], OmniDiffusionSamplingParams(**PARAMS))
    finally:
        omni.close()
    assert out.error is None, out.error
    got = np.asarray(out.images[0], dtype=np.float64)
    assert got.std() > 1.0
    assert psnr(got, want) >= 60.0
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _engine_process(proc: psutil.Process) -> bool:
    """A child of ours in our session (live servers run in sessions of their own) other than multiprocessing's
    resource tracker, the interpreter's helper that lives as long as we do."""
    try:
        return os.getsid(proc.pid) == os.getsid(0) and not multiprocessing_helper(proc)
    except (psutil.NoSuchProcess, ProcessLookupError):  # exited, or a zombie, while we looked
        return False
