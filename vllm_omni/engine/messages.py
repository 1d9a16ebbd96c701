"""Typed messages between the frontend and the Orchestrator's loop (request, output and rpc queues).

Fields are append-only; `type` is the discriminator. Results that answer a correlated call carry
`rpc_correlation_key` so `RpcResultRouter` can hand them to the waiting caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import msgspec

from vllm_omni.catalog.spec import Modality

if TYPE_CHECKING:
    from vllm import SamplingParams

    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

StagePrompt = str | dict[str, Any] | list[Any]
"""A text prompt, a prompt dict ("prompt", "multi_modal_data", model-specific keys such as "voice"), or the
item list a GENERATION stage takes."""
PauseMode = Literal["abort", "wait", "keep"]


class EngineQueueMessage(msgspec.Struct, kw_only=True):
    pass


class AddRequestMessage(EngineQueueMessage, kw_only=True):
    type: Literal["add"] = "add"
    request_id: str
    prompt: StagePrompt
    sampling_params_list: list[SamplingParams | OmniDiffusionSamplingParams | None]
    """One entry per stage (vLLM `SamplingParams` for AR stages, `OmniDiffusionSamplingParams` for diffusion,
    None for a GENERATION stage)."""
    arrival_time: float = 0.0
    output_modalities: list[Modality] | None = None
    """Final outputs the caller wants ("text", "audio", ...): the request stops after the last stage that makes
    one of them (text-only Qwen3-Omni skips talker and vocoder). None = every final output."""


class AbortRequestMessage(EngineQueueMessage, kw_only=True):
    type: Literal["abort"] = "abort"
    request_ids: list[str]
    rpc_id: str | None = None
    """Set when the caller waits for an `AbortResultMessage`."""


class AbortResultMessage(EngineQueueMessage, kw_only=True):
    type: Literal["abort_result"] = "abort_result"
    rpc_id: str
    success: bool
    error: str | None = None

    @property
    def rpc_correlation_key(self) -> tuple[str, str]:
        return ("abort", self.rpc_id)


class CollectiveRPCRequestMessage(EngineQueueMessage, kw_only=True):
    type: Literal["collective_rpc"] = "collective_rpc"
    rpc_id: str
    method: str
    args: tuple[Any, ...] = ()
    """Arguments of `method`, whatever the worker or EngineCore method takes."""
    kwargs: dict[str, Any] | None = None
    stage_ids: list[int] | None = None
    """None = every stage."""
    timeout: float | None = None


class CollectiveRPCResultMessage(EngineQueueMessage, kw_only=True):
    type: Literal["collective_rpc_result"] = "collective_rpc_result"
    rpc_id: str
    results: dict[int, list[Any]] = msgspec.field(default_factory=dict)
    """stage id -> one result per replica: the method's return value, or a `StageRpcError`."""
    error: str | None = None

    @property
    def rpc_correlation_key(self) -> tuple[str, str]:
        return ("collective_rpc", self.rpc_id)


class ErrorMessage(EngineQueueMessage, kw_only=True):
    """A request failed (`request_id` set) or the engine died (`fatal`, broadcast to every waiter)."""

    type: Literal["error"] = "error"
    error: str
    request_id: str | None = None
    status_code: int = 500
    error_type: str | None = None
    fatal: bool = False
    param: str | None = None
    """The offending request field, for client errors."""
    rpc_correlation_key: tuple[str, str] | None = None


class StageRpcError(msgspec.Struct, frozen=True, kw_only=True):
    """One replica could not run a control call; it stands in that replica's result."""

    stage_id: int
    replica_id: int
    method: str
    reason: Literal["not_attached", "unsupported", "timeout", "failed"]
    error: str


class ShutdownMessage(EngineQueueMessage, kw_only=True):
    type: Literal["shutdown"] = "shutdown"


class CuMemTag:
    """Memory tags a sleeping stage releases (and `wake_up(tags=...)` restores)."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"


class AckMetadata(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How a stage did a sleep / wake task: through EngineCore (AR) or the diffusion workers."""

    path: Literal["engine_core", "worker"]
    level: int | None = None
    mode: PauseMode | None = None
    tags: list[str] | None = None


class OmniACK(msgspec.Struct, kw_only=True):
    """Acknowledgement of a sleep / wake task by one stage (rank 0 summarizes a multi-rank stage)."""

    task_id: str
    status: Literal["SUCCESS"]
    """A failed task raises instead of acknowledging."""
    stage_id: int
    rank: int = 0
    metadata: AckMetadata
