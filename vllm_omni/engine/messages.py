"""Typed messages between the frontend and the Orchestrator's loop (request, output and rpc queues).

Fields are append-only; `type` is the discriminator. Results that answer a correlated call carry
`rpc_correlation_key` so `RpcResultRouter` can hand them to the waiting caller.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class EngineQueueMessage(msgspec.Struct, kw_only=True):
    pass


class AddRequestMessage(EngineQueueMessage, kw_only=True):
    type: Literal["add"] = "add"
    request_id: str
    prompt: Any
    sampling_params_list: list[Any]
    """One entry per stage (vLLM `SamplingParams` for AR stages, `OmniDiffusionSamplingParams` for diffusion)."""
    arrival_time: float = 0.0
    output_modalities: list[str] | None = None
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
    kwargs: dict[str, Any] | None = None
    stage_ids: list[int] | None = None
    """None = every stage."""
    timeout: float | None = None


class CollectiveRPCResultMessage(EngineQueueMessage, kw_only=True):
    type: Literal["collective_rpc_result"] = "collective_rpc_result"
    rpc_id: str
    results: dict[int, list[Any]] = msgspec.field(default_factory=dict)
    """stage id -> one result per replica (a dict with "error" when that replica failed)."""
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


class ShutdownMessage(EngineQueueMessage, kw_only=True):
    type: Literal["shutdown"] = "shutdown"


class CuMemTag:
    """Memory tags a sleeping stage releases (and `wake_up(tags=...)` restores)."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"


class OmniACK(msgspec.Struct, kw_only=True):
    """Acknowledgement of a sleep / wake task by one stage (rank 0 summarizes a multi-rank stage)."""

    task_id: str
    status: str
    stage_id: int
    rank: int = 0
    metadata: dict[str, Any] = {}
