"""What each rank runs in the parallelism tests: a native pipeline from a tiny checkpoint, end to end.

Importable by name so the spawned ranks can unpickle the job functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.inputs.data import OmniDiffusionSamplingParams


def run_pipeline(model_dir: str, parallel: dict, prompt: dict, params: dict) -> dict[str, np.ndarray]:
    """Final latents and decoded output of one request, as float64 arrays."""
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    od_config = OmniDiffusionConfig(model=model_dir, parallel_config=DiffusionParallelConfig(**parallel))
    runner = DiffusionModelRunner(od_config, torch.device("cpu"))
    runner.load_model()
    pipe = runner.pipeline
    request = OmniDiffusionRequest(prompt, OmniDiffusionSamplingParams(**params), "r0")
    ctx = StepContext(od_config, request_ids=["r0"])
    with torch.inference_mode():
        state = pipe.prepare([request], ctx)
        pipe.denoise(state, ctx)
        latents = state.latents.clone()
        (out,) = pipe.finish(state, ctx)
    assert out.error is None, out.error
    return {"latents": latents.double().numpy(), "output": _as_array(out.output)}


def _as_array(output: Any) -> np.ndarray:
    if isinstance(output, dict):  # video pipelines
        output = output["video"]
    return np.asarray(output, dtype=np.float64)


def psnr(got: np.ndarray, want: np.ndarray) -> float:
    """PSNR against the peak of `want` (inf when equal)."""
    mse = float(np.mean((got - want) ** 2))
    peak = float(np.abs(want).max())
    return float("inf") if mse == 0 else 10 * np.log10(peak**2 / mse)
