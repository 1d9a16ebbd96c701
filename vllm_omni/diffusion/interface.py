"""The contract between the diffusion runtime and a pipeline.

A pipeline is built by the model runner inside a worker process with the classmethod
`from_pretrained(od_config, model_dir, device, dtype)` and answers `forward(batch, ctx) -> list[DiffusionOutput]`
with one output per request in batch order (a request that fails alone carries `error`, the others go on);
a pipeline that sets `supports_step_execution` (every `NativeDiffusionPipeline`) may instead be driven one
denoise step at a time by the worker's step executor (`prepare` / `denoise_step` / `finish`);
`ctx` (a `StepContext`) carries the partial-output sink and the abort flag polled between denoise steps.
The model registry (`vllm_omni/catalog/registry.py`) maps a checkpoint's `_class_name` to the pipeline class.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
    from vllm_omni.diffusion.step_context import StepContext
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch


@runtime_checkable
class DiffusionPipeline(Protocol):
    supports_request_batch: ClassVar[bool]
    """True when `forward` accepts more than one request per call (same sampling-params key)."""

    @classmethod
    def from_pretrained(cls, od_config: OmniDiffusionConfig, model_dir: Path, device: Any, dtype: Any) -> Any: ...

    def forward(self, batch: DiffusionRequestBatch, ctx: StepContext) -> list[DiffusionOutput]: ...


def supports_request_batch(pipeline_cls: type) -> bool:
    return bool(getattr(pipeline_cls, "supports_request_batch", False))


def supports_step_execution(pipeline_cls: type) -> bool:
    """True for pipelines whose work is `prepare` / `denoise_step` / `finish` over a `DenoiseState`."""
    return bool(getattr(pipeline_cls, "supports_step_execution", False))
