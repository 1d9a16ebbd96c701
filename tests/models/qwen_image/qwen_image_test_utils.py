"""Helpers shared by the Qwen-Image tests (image comparison, request building)."""

from __future__ import annotations


def psnr(a, b) -> float:
    """PSNR in dB of two images (PIL or float arrays in [0, 1])."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64) / (255.0 if not np.issubdtype(np.asarray(a).dtype, np.floating) else 1.0)
    b = np.asarray(b, dtype=np.float64) / (255.0 if not np.issubdtype(np.asarray(b).dtype, np.floating) else 1.0)
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def make_request(prompt, request_id="r", image=None, **params):
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    if image is not None:
        prompt = {"prompt": prompt, "multi_modal_data": {"image": image}}
    return OmniDiffusionRequest(prompt, OmniDiffusionSamplingParams(**params), request_id)
