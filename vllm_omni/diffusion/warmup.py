"""Start-up warm-up of the compiled path: compile and capture what serving will run before the stage says ready.

A compiled DiT compiles (seconds) and captures a CUDA graph (a few forwards) the first time it sees an input
signature: image size x transformer rows x text length. Left to serving, that stall lands on whichever request
first brings the signature, and on every request batched with it. So the worker runs, after loading and before
it reports itself loaded, a short generation for each configured size (`--diffusion-warmup-shapes`, default the
model's own) at every batch bucket the stage can form: powers of two up to `--max-num-seqs`, as vLLM's CUDA-graph
capture sizes, in step mode only those whose tokens fit one co-batched forward, and at every text-length bucket
a default request can reach (`TEXT_BUCKETS`: a family pads its prompt tokens to the next bucket under a key mask,
so that prompt lengths make no new signature). A family without text buckets gets prompts of two lengths, which
make Dynamo compile its symbolic-size graph here rather than at the first request with another prompt length.
A family whose negative prompt adds transformer rows (true CFG, `warmup_guided`) runs every bucket unguided and
guided: a guided request is a signature of its own (twice the rows, its own image-shape list).
Afterwards every compile or capture logs a WARNING (`CompiledForward`).

On CUDA the warm-up then measures, at each size, the peak device memory one request takes beyond what the worker
holds (`measure_peaks`): memory admission predicts requests at those sizes from it (`ShapeRule.measured_peaks`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm_omni.diffusion.data import OmniDiffusionConfig, parse_warmup_shapes
from vllm_omni.diffusion.layers.compile import CompiledForward, compiled_forwards
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

WARMUP_STEPS = 2
"""Denoise steps per warm-up generation: the first step compiles and captures, the second replays."""
GUIDED_TRUE_CFG_SCALE = 4.0
"""The guidance of guided warm-up requests: any scale > 1 makes the same signature."""
TEXT_BUCKETS = (128, 256, 512, 1024)
"""Prompt-token lengths the compiled path pads text up to: few CUDA graphs per (size, batch), at most 2x the
text tokens (a 512x512 image has 1024 image tokens, so the padding costs at most ~1/8 of a short prompt's
forward)."""
WARMUP_WORDS = ("a", "watercolor", "painting", "of", "a", "lighthouse", "on", "a", "cliff", "above", "the", "sea",
                "at", "dusk", "with", "gulls", "in", "the", "wind", "and", "warm", "light")
"""Warm-up prompts are prefixes of this text: each row of a batch gets its own length, and each bucket runs twice
with other lengths. A compiled block first specializes on the text lengths it saw (and on which of them were
equal): only a second, different set makes Dynamo compile the symbolic-length graph that later prompts reuse."""


@dataclass
class WarmedSignature:
    """One (size, batch) the warm-up ran, with what it cost."""

    size: tuple[int, int] | None
    """(width, height); None = the model's default size."""
    batch: int
    seconds: float
    compiles: int
    captures: int
    text: int | None = None
    """Prompt words of the warm-up requests (one text bucket); None = the family has no text buckets."""
    guided: bool = False
    """Whether the requests carried a negative prompt with true CFG (negative rows in every forward)."""

    @property
    def label(self) -> str:
        size = "default size" if self.size is None else f"{self.size[0]}x{self.size[1]}"
        text = "" if self.text is None else f" text {self.text}"
        return f"{size} batch {self.batch}{text}" + (" guided" if self.guided else "")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below `max_num_seqs`, then `max_num_seqs`: the batch sizes a stage captures (vLLM's capture
    sizes likewise end at the largest batch)."""
    buckets = [1]
    while buckets[-1] * 2 < max_num_seqs:
        buckets.append(buckets[-1] * 2)
    return buckets if max_num_seqs <= 1 else [*buckets, max_num_seqs]


def step_bucket(count: int, buckets: list[int]) -> int:
    """The smallest of `buckets` that holds `count` states (`count` itself beyond the largest)."""
    return next((bucket for bucket in buckets if bucket >= count), count)


def warm_up(pipeline: Any, od_config: OmniDiffusionConfig, device: Any,
            rank: int = 0) -> tuple[list[WarmedSignature], list[MeasuredPeak]]:
    """Run the warm-up on a loaded pipeline (nothing when it has no compiled DiT or the shapes are ""), measure
    the peaks (`measure_peaks`), then mark its compiled forwards as serving. Every rank of a stage runs the same
    warm-up (same collectives)."""
    forwards = compiled_forwards(pipeline)
    shapes = parse_warmup_shapes(od_config.diffusion_warmup_shapes)
    warmed: list[WarmedSignature] = []
    if forwards and shapes != []:
        step_mode = od_config.step_execution and pipeline.supports_step_execution
        texts: list[int | None] = list(pipeline.warmup_text_lengths()) or [None]
        guided = [False, True] if pipeline.warmup_guided() else [False]
        buckets = batch_buckets(od_config.max_num_seqs)
        planned = len(shapes or [None]) * len(buckets) * len(texts) * len(guided)
        for forward in forwards:
            if forward.runner is not None:  # keep every warmed graph (the LRU bound would evict some)
                forward.runner.max_graphs = max(forward.runner.max_graphs, planned)
        for size in shapes or [None]:
            for smaller, batch in zip([0, *buckets], buckets, strict=False):
                fits = [_warm_one(pipeline, od_config, forwards, size, batch, text, cfg, step_mode, smaller + 1, rank)
                        for cfg in guided for text in texts]
                warmed += [signature for signature in fits if signature is not None]
                if fits[0] is None:
                    break  # larger buckets never co-batch either
    peaks = measure_peaks(pipeline, od_config, device, rank) if warmed else []
    for forward in forwards:
        forward.serving = True
    return warmed, peaks


@dataclass(frozen=True)
class MeasuredPeak:
    size: tuple[int, int] | None
    """(width, height); None = the model's default size."""
    bytes: int
    """Peak allocated device memory of the request beyond what was allocated before it."""
    steps: int = WARMUP_STEPS
    """The request's denoise steps."""


def measure_peaks(pipeline: Any, od_config: OmniDiffusionConfig, device: Any, rank: int = 0) -> list[MeasuredPeak]:
    """On CUDA, after the warm-up: one default request per warm-up size, with a negative prompt (CFG on
    wherever the family's default guidance runs it: the larger case) and `WARMUP_STEPS` steps, measured on the
    graphs the warm-up captured (guided too where a negative prompt adds rows), as serving runs them. Then the
    allocator's cache is emptied, so that the free memory the worker reports next counts what the warm-up left
    cached."""
    import torch

    if device.type != "cuda":
        return []
    peaks = []
    for size in parse_warmup_shapes(od_config.diffusion_warmup_shapes) or [None]:
        plain = _request(size, 0)
        request = OmniDiffusionRequest({"prompt": plain.prompt, "negative_prompt": "blurry, low quality"},
                                       plain.sampling_params, "warmup-peak")
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        (output,) = pipeline.forward(DiffusionRequestBatch([request]))
        torch.cuda.synchronize(device)
        if output.error is not None:  # then requests at this size are predicted by the model alone
            logger.warning("[diffusion rank %d] peak memory at %s not measured: %s", rank, size, output.error)
            continue
        peaks.append(MeasuredPeak(size, torch.cuda.max_memory_allocated(device) - before))
        logger.info("[diffusion rank %d] peak memory of one request at %s: %.1f MiB", rank,
                    "default size" if size is None else f"{size[0]}x{size[1]}", peaks[-1].bytes / 2**20)
    torch.cuda.empty_cache()
    return peaks


def _warm_one(pipeline: Any, od_config: OmniDiffusionConfig, forwards: list[CompiledForward],
              size: tuple[int, int] | None, batch: int, text: int | None, guided: bool, step_mode: bool,
              fewest: int, rank: int) -> WarmedSignature | None:
    """One (size, batch, text bucket, guidance) generation; None when step mode cannot co-batch `fewest` such
    states."""
    before = _counts(forwards)
    start = time.perf_counter()
    for lengths_set in range(2 if text is None else 1):
        requests = [_request(size, i, lengths_set, text, guided) for i in range(batch)]
        if step_mode:
            if not _step_batch(pipeline, od_config, requests, fewest):
                return None
        else:
            pipeline.forward(DiffusionRequestBatch(requests))
    compiles, captures = (after - prior for after, prior in zip(_counts(forwards), before, strict=True))
    signature = WarmedSignature(size, batch, time.perf_counter() - start, compiles, captures, text, guided)
    logger.info("[diffusion rank %d] warm-up %s: %.2f s (%d graphs compiled, %d CUDA graphs captured)",
                rank, signature.label, signature.seconds, compiles, captures)
    return signature


def _request(size: tuple[int, int] | None, index: int, lengths_set: int = 0,
             text: int | None = None, guided: bool = False) -> OmniDiffusionRequest:
    """Warm-up request `index` of a batch: a prefix of `WARMUP_WORDS`, or (`text`) about `text` one-token words,
    each row a little shorter than the last (rows of one batch differ in length, as served ones do); `guided`
    adds a negative prompt of the same length under true CFG."""
    width, height = size or (None, None)
    params = OmniDiffusionSamplingParams(width=width, height=height, num_inference_steps=WARMUP_STEPS, seed=index,
                                         true_cfg_scale=GUIDED_TRUE_CFG_SCALE if guided else None)
    if text is None:
        words = (2 + 3 * index + lengths_set) % len(WARMUP_WORDS) + 1
        prompt = " ".join(WARMUP_WORDS[:words])
    else:
        prompt = " ".join(["a"] * max(1, text - 3 * index))
    if guided:
        return OmniDiffusionRequest({"prompt": prompt, "negative_prompt": prompt}, params, f"warmup-{index}")
    return OmniDiffusionRequest(prompt, params, f"warmup-{index}")


def _counts(forwards: list[CompiledForward]) -> tuple[int, int]:
    return sum(f.compiles for f in forwards), sum(f.captures for f in forwards)


def _step_batch(pipeline: Any, od_config: OmniDiffusionConfig, requests: list[OmniDiffusionRequest],
                fewest: int) -> bool:
    """The step executor's arithmetic for one co-batched group: one state per request, every step ONE forward
    over all of them (`denoise_step_batch` pads a smaller group up to this bucket), then each decodes. False
    (nothing run) when not even `fewest` states (one more than the bucket below) fit one forward."""
    ctxs = [StepContext(od_config, request_ids=[r.request_id]) for r in requests]
    states = [pipeline.prepare([r], ctx) for r, ctx in zip(requests, ctxs, strict=True)]
    cap = od_config.diffusion_max_tokens_per_forward
    if len(states) > 1 and (pipeline.forward_group_key(states[0]) is None
                            or (cap is not None and sum(map(pipeline.step_tokens, states[:fewest])) > cap)):
        return False
    while not states[0].done:
        for error in pipeline.denoise_step_batch(states, ctxs):
            if error is not None:
                raise error
    for state, ctx in zip(states, ctxs, strict=True):
        pipeline.finish(state, ctx)
    return True
