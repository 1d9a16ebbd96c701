"""Builds the pipeline and runs one forward per scheduled batch, with timing and peak memory.

A batch whose forward raises is retried one request at a time, so the request that broke it fails alone
and the others still get their outputs. On several ranks every rank must take the same path: the ranks agree
on what failed after each forward (`distributed/rank_errors.py`).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_omni.catalog.registry import MODEL_REGISTRY
from vllm_omni.catalog.resolution import resolve_model_dir, resolve_pipeline_class_name
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.distributed.rank_errors import RanksDesynchronized, agree_on_failures
from vllm_omni.diffusion.layers.compile import accelerate_vae_if_requested, compile_stats
from vllm_omni.diffusion.offload.components import apply_cpu_offload
from vllm_omni.diffusion.step_context import PartialSink, StepContext
from vllm_omni.diffusion.warmup import MeasuredPeak, warm_up
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_torch_dtype(dtype: str | torch.dtype, device_type: str) -> torch.dtype:
    """`auto` -> bfloat16 on accelerators, float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device_type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


class DiffusionModelRunner:
    def __init__(self, od_config: OmniDiffusionConfig, device: torch.device, rank: int = 0) -> None:
        self.od_config = od_config
        self.device = device
        self.rank = rank
        self.dtype = resolve_torch_dtype(od_config.dtype, device.type)
        self.pipeline: Any = None
        self.pipeline_class_name: str | None = None
        self.startup_phases: dict[str, float] = {}
        """Seconds of the last `load_model`: loading the weights, then the warm-up (compile / capture)."""
        self.measured_peaks: list[MeasuredPeak] = []
        """CUDA: one request's peak memory at each warm-up size (`warmup.measure_peaks`), for memory admission."""

    def load_model(self) -> None:
        model_dir = resolve_model_dir(self.od_config.model, self.od_config.revision,
                                      with_weights=self.od_config.load_format != "dummy")
        self.pipeline_class_name = resolve_pipeline_class_name(self.od_config, model_dir)
        cls = MODEL_REGISTRY.load_pipeline_class(self.pipeline_class_name, self.od_config.use_diffusers_adapter)
        start = time.perf_counter()
        self.pipeline = cls.from_pretrained(self.od_config, model_dir, self.device, self.dtype)
        if self.od_config.enable_cpu_offload:
            apply_cpu_offload(self.pipeline, self.device)
        accelerate_vae_if_requested(self.pipeline, self.od_config)  # compiled by the warm-up's decodes
        loaded = time.perf_counter()
        logger.info(
            "[diffusion rank %d] loaded %s as %s on %s (%s) in %.2f s",
            self.rank, model_dir, cls.__name__, self.device, self.dtype, loaded - start,
        )
        self.warm_up()
        self.startup_phases = {"load": loaded - start, "warm-up": time.perf_counter() - loaded}

    @torch.inference_mode()  # as serving runs: Dynamo guards on the grad mode
    def warm_up(self) -> None:
        """Compile and capture every configured (shape, batch bucket) before the worker reports itself loaded,
        then (CUDA) measure one request's peak at each size (`diffusion/warmup.py`); nothing on the eager path."""
        start = time.perf_counter()
        warmed, self.measured_peaks = warm_up(self.pipeline, self.od_config, self.device, self.rank)
        if warmed:
            logger.info("[diffusion rank %d] warm-up of %d signatures done in %.2f s", self.rank, len(warmed),
                        time.perf_counter() - start)

    def unload_model(self) -> None:
        self.pipeline = None

    @torch.inference_mode()
    def execute_model(self, batch: DiffusionRequestBatch, partial_sink: PartialSink | None = None,
                      abort_requested: Callable[[str], bool] | None = None) -> list[DiffusionOutput]:
        """`partial_sink` receives the pipeline's partial results (a request retried alone after its batch
        failed reports its progress again from the start); `abort_requested(request_id)` is polled by the
        pipeline between denoise steps (None: nothing is ever aborted)."""
        if self.pipeline is None:
            raise RuntimeError("the diffusion worker is asleep; call wake_up() first")
        self._reset_peak_memory()
        start = time.perf_counter()
        if self.od_config.enable_distributed_layerwise_offload:  # DLO: each rank owns its request's outcome
            outputs = self._forward(batch, partial_sink, abort_requested)
            outputs = [outputs] * len(batch) if isinstance(outputs, DiffusionOutput) else outputs
        else:
            outputs = self._agreed(self._forward(batch, partial_sink, abort_requested), len(batch))
        if outputs is None:
            logger.warning("[diffusion rank %d] batch of %d failed; retrying one by one", self.rank, len(batch))
            outputs = [self._agreed(self._forward(DiffusionRequestBatch([request]), partial_sink,
                                                  abort_requested), 1)[0]
                       for request in batch.requests]
        elapsed = time.perf_counter() - start
        peak, compiled = self.peak_memory_mb(), compile_stats(self.pipeline)
        for out in outputs:
            out.stage_durations.setdefault("forward", elapsed)
            out.peak_memory_mb = peak
            out.compile_stats = compiled
        return outputs

    @staticmethod
    def _agreed(outputs: list[DiffusionOutput] | DiffusionOutput, size: int) -> list[DiffusionOutput] | None:
        """`_forward`'s result as every rank agrees on it (`rank_errors.py`): a request failed on one rank fails
        on all; None when the batch as a whole raised on every rank (then every rank retries one by one).
        Raises `RanksDesynchronized` (outputs keyed by request index) when the ranks failed differently."""
        whole = isinstance(outputs, DiffusionOutput)
        failed = {"batch": outputs} if whole else {i: out for i, out in enumerate(outputs) if out.error is not None}
        try:
            agreed = agree_on_failures(failed)
        except RanksDesynchronized as exc:
            if "batch" in exc.outputs:  # every request of the batch gets the batch's error
                exc.outputs = dict.fromkeys(range(size), exc.outputs["batch"])
            raise
        if whole:
            return None
        return [agreed.get(i, out) for i, out in enumerate(outputs)]

    def _forward(self, batch: DiffusionRequestBatch, partial_sink: PartialSink | None,
                 abort_requested: Callable[[str], bool] | None) -> list[DiffusionOutput] | DiffusionOutput:
        """The pipeline's outputs, or the batch's error when the batch as a whole raised (and has more than one
        request)."""
        ctx = StepContext(self.od_config, request_ids=batch.request_ids, partial_sink=partial_sink)
        if abort_requested is not None:
            ctx.abort_requested = abort_requested
        try:
            outputs = self.pipeline.forward(batch, ctx)
            if len(outputs) != len(batch):
                raise RuntimeError(f"pipeline returned {len(outputs)} outputs for {len(batch)} requests")
            return outputs
        except Exception as exc:
            if len(batch) > 1:
                return DiffusionOutput.from_exception(exc)
            logger.info("[diffusion rank %d] request %s failed: %s", self.rank, batch.request_ids[0], exc)
            return [DiffusionOutput.from_exception(exc)]

    def _reset_peak_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_mb(self) -> float:
        """Peak device memory since the last reset (this forward in request mode) on CUDA; the worker's
        lifetime peak RSS on CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
