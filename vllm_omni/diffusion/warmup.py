"""Start-up warm-up of the compiled path: compile and capture what serving will run before the stage says ready.

A compiled DiT compiles (seconds) and captures a CUDA graph (a few forwards) the first time it sees an input
signature: image size x transformer rows x text length. Left to serving, that stall lands on whichever request
first brings the signature, and on every request batched with it. So the worker runs, after loading and before
it reports itself loaded, a short generation for each configured size (`--diffusion-warmup-shapes`, default the
model's own) at every batch bucket the stage can form: powers of two up to `--max-num-seqs`, as vLLM's CUDA-graph
capture sizes, in step mode only those whose tokens fit one co-batched forward. Prompts of two lengths make Dynamo
compile its symbolic-size graph here rather than at the first request with another prompt length. Afterwards every
compile or capture logs a WARNING (`AcceleratedForward`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm_omni.diffusion.data import OmniDiffusionConfig, parse_warmup_shapes
from vllm_omni.diffusion.layers.compile import AcceleratedForward, accelerated_forwards
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

WARMUP_STEPS = 2
"""Denoise steps per warm-up generation: the first step compiles and captures, the second replays."""
WARMUP_PROMPTS = ("a cat", "a watercolor painting of a lighthouse on a cliff above a stormy sea at dusk, "
                  "gulls in the wind, warm light in the windows")
"""Two prompt lengths, so the text dimension is seen to vary during the warm-up."""


@dataclass
class WarmedSignature:
    """One (size, batch) the warm-up ran, with what it cost."""

    size: tuple[int, int] | None
    """(width, height); None = the model's default size."""
    batch: int
    seconds: float
    compiles: int
    captures: int

    @property
    def label(self) -> str:
        size = "default size" if self.size is None else f"{self.size[0]}x{self.size[1]}"
        return f"{size} batch {self.batch}"


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to `max_num_seqs`: the batch sizes a stage captures."""
    buckets = [1]
    while buckets[-1] * 2 <= max_num_seqs:
        buckets.append(buckets[-1] * 2)
    return buckets


def warm_up(pipeline: Any, od_config: OmniDiffusionConfig, rank: int = 0) -> list[WarmedSignature]:
    """Run the warm-up on a loaded pipeline (nothing when it has no compiled DiT or the shapes are ""); then
    mark its compiled forwards as serving. Every rank of a stage runs the same warm-up (same collectives)."""
    forwards = accelerated_forwards(pipeline)
    shapes = parse_warmup_shapes(od_config.diffusion_warmup_shapes)
    warmed: list[WarmedSignature] = []
    if forwards and shapes != []:
        step_mode = od_config.step_execution and pipeline.supports_step_execution
        for size in shapes or [None]:
            for batch in batch_buckets(od_config.max_num_seqs):
                requests = [_request(size, i) for i in range(batch)]
                before = _counts(forwards)
                start = time.perf_counter()
                if step_mode:
                    ran = _step_batch(pipeline, od_config, requests)
                else:
                    pipeline.forward(DiffusionRequestBatch(requests))
                    ran = True
                if not ran:
                    break  # larger buckets never co-batch either
                compiles, captures = (after - prior for after, prior in zip(_counts(forwards), before, strict=True))
                signature = WarmedSignature(size, batch, time.perf_counter() - start, compiles, captures)
                warmed.append(signature)
                logger.info("[diffusion rank %d] warm-up %s: %.2f s (%d graphs compiled, %d CUDA graphs captured)",
                            rank, signature.label, signature.seconds, compiles, captures)
    for forward in forwards:
        forward.serving = True
    return warmed


def _request(size: tuple[int, int] | None, index: int) -> OmniDiffusionRequest:
    width, height = size or (None, None)
    params = OmniDiffusionSamplingParams(width=width, height=height, num_inference_steps=WARMUP_STEPS, seed=index)
    return OmniDiffusionRequest(WARMUP_PROMPTS[index % 2], params, f"warmup-{index}")


def _counts(forwards: list[AcceleratedForward]) -> tuple[int, int]:
    return sum(f.compiles for f in forwards), sum(f.captures for f in forwards)


def _step_batch(pipeline: Any, od_config: OmniDiffusionConfig, requests: list[OmniDiffusionRequest]) -> bool:
    """The step executor's arithmetic for one co-batched group: one state per request, every step ONE forward
    over all of them, then each decodes. False (nothing run) when the group would not fit one forward."""
    ctxs = [StepContext(od_config, request_ids=[r.request_id]) for r in requests]
    states = [pipeline.prepare([r], ctx) for r, ctx in zip(requests, ctxs, strict=True)]
    cap = od_config.diffusion_max_tokens_per_forward
    if len(states) > 1 and (pipeline.forward_group_key(states[0]) is None
                            or (cap is not None and sum(map(pipeline.step_tokens, states)) > cap)):
        return False
    while not states[0].done:
        for error in pipeline.denoise_step_batch(states, ctxs):
            if error is not None:
                raise error
    for state, ctx in zip(states, ctxs, strict=True):
        pipeline.finish(state, ctx)
    return True
