"""Control routes of vllm-omni: `/v1/omni/sleep` and `/v1/omni/wakeup`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from vllm_omni.entrypoints.openai.protocol.common import CheckedBody


class SleepRequest(CheckedBody):
    model_config = ConfigDict(extra="forbid")

    level: Literal[1, 2] = 1
    """1: offload weights, drop caches; 2: drop weights too (reload on wake)."""
    stage_ids: list[int] | None = None
    """Stages to put to sleep; None = all."""


class WakeupRequest(CheckedBody):
    model_config = ConfigDict(extra="forbid")

    tags: list[Literal["weights", "kv_cache"]] | None = None
    """What to restore; None = everything."""
    stage_ids: list[int] | None = None
    resume: bool = True
    """Reopen admission after waking (AR stages keep it closed until resumed)."""


class ControlResponse(BaseModel):
    status: Literal["ok"] = "ok"
    acks: list[dict] = []
