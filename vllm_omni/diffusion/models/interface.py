"""The contract between the diffusion runtime and a pipeline.

A pipeline is built by the model runner inside a worker process as `cls(od_config=..., device=...)`,
loads its weights with `load_weights(model_path)`, and answers `forward(batch) -> list[DiffusionOutput]`
with one output per request in batch order (a request that fails alone carries `error`, the others go on).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch


@runtime_checkable
class DiffusionPipeline(Protocol):
    supports_request_batch: ClassVar[bool]
    """True when `forward` accepts more than one request per call (same sampling-params key)."""

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]: ...


def supports_request_batch(pipeline_cls: type) -> bool:
    return bool(getattr(pipeline_cls, "supports_request_batch", False))
