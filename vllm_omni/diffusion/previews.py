"""Partial images: decoded previews of a request's result while it denoises (`partial_images`, 0-3).

After the steps `preview_steps` picks (evenly spaced, never the last one), the pipeline decodes the clean-image
estimate of the request's rows with its own `decode` and sends it as a "partial_image" partial
({"images": [...], "index": k}). For flow-matching schedulers (every native image family) the estimate is
x0 = x_t - sigma_t * v, from the latents before the step and the guided velocity; a scheduler without `sigmas`
previews its current latents. The final output is unaffected: nothing here writes to the state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.diffusion.state import DenoiseState, select_conditioning

if TYPE_CHECKING:
    from vllm_omni.diffusion.step_context import StepContext


def preview_steps(total: int, count: int) -> list[int]:
    """Numbers of steps done after which a preview goes out, ascending; fewer than `count` when steps are few."""
    return sorted({round(total * (k + 1) / (count + 1)) for k in range(count)} - {0, total})


def emit_previews(decode: Callable[[DenoiseState], Sequence[Any]], state: DenoiseState, ctx: StepContext,
                  latents_before: torch.Tensor, noise_pred: torch.Tensor) -> None:
    """Called right after a step; a no-op unless a request of `state` asked for a preview at this step.
    `decode`: the pipeline's, applied to a copy of `state` holding the one request's clean-image estimate."""
    if not ctx.partials_enabled:
        return
    per = state.outputs_per_request
    for i, request in enumerate(state.requests):
        steps = preview_steps(len(state.timesteps), request.sampling_params.partial_images)
        if state.step_index not in steps:
            continue
        rows = torch.arange(i * per, (i + 1) * per, device=state.latents.device)
        preview = copy.copy(state)
        preview.requests = [request]
        preview.latents = _clean_estimate(state, latents_before, noise_pred).index_select(0, rows)
        preview.conditioning = select_conditioning(state.conditioning, rows, state.latents.shape[0])
        images = list(decode(preview))
        ctx.emit_partial(request.request_id, "partial_image", {"images": images, "index": steps.index(
            state.step_index)})


def _clean_estimate(state: DenoiseState, latents_before: torch.Tensor, noise_pred: torch.Tensor) -> torch.Tensor:
    sigmas = getattr(state.scheduler, "sigmas", None)
    if sigmas is None:
        return state.latents
    sigma = sigmas[state.step_index - 1].to(latents_before.device, torch.float32)
    return (latents_before.float() - sigma * noise_pred.float()).to(state.latents.dtype)
