"""Typed results of the engine's control calls (returned to callers, not a queue protocol: the Orchestrator runs on
the caller's loop, so requests and outputs are plain calls and objects).
"""

from __future__ import annotations

from typing import Literal

import msgspec

PauseMode = Literal["abort", "wait", "keep"]


class StageRpcError(msgspec.Struct, frozen=True, kw_only=True):
    """One replica could not run a control call; it stands in that replica's result."""

    stage_id: int
    replica_id: int
    method: str
    reason: Literal["not_attached", "unsupported", "timeout", "failed"]
    error: str


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
