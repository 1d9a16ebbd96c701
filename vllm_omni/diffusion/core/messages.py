"""Messages between a `DiffusionCoreClient` (API process) and its diffusion core process.

One socket pair, as vLLM's EngineCore: requests, aborts and utility calls go in on one, every output (partials,
finals, utility results, state changes) comes back on the other, in the order the core produced them. All are
tagged msgspec structs encoded by `ipc.MsgCodec` (large arrays through shared memory).
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_omni.catalog.shapes import ShapeRule
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.errors import EngineDeadError, OmniClientError, OmniError, StageRestartingError


class CoreAddRequest(msgspec.Struct, tag="add", array_like=True, gc=False):
    request: OmniDiffusionRequest
    stream: bool = False
    """The caller reads the request's partials (denoise progress, video chunks) before its final output."""


class CoreAbort(msgspec.Struct, tag="abort", array_like=True, gc=False):
    """Stop these requests; answered by a `CoreUtilityResult` (True once the workers left them, False after
    `wait_s`), so that what the caller counts as running is what the workers run."""

    call_id: int
    request_ids: list[str]
    wait_s: float


class CoreUtility(msgspec.Struct, tag="utility", array_like=True, gc=False):
    """`collective_rpc` on the workers; answered by a `CoreUtilityResult`."""

    call_id: int
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


CoreInput = CoreAddRequest | CoreAbort | CoreUtility


class CoreError(msgspec.Struct, array_like=True, gc=False):
    """An exception that crossed the boundary, rebuilt as the same class of error on the client."""

    kind: str
    """"client" (4xx, names `param`), "dead", "restarting" or "internal"."""
    message: str
    status_code: int = 500
    param: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> CoreError:
        if isinstance(exc, OmniClientError):
            return cls("client", exc.message, exc.status_code, exc.param)
        if isinstance(exc, StageRestartingError):
            return cls("restarting", str(exc), exc.status_code)
        if isinstance(exc, EngineDeadError):
            return cls("dead", str(exc), exc.status_code)
        status = exc.status_code if isinstance(exc, OmniError) else 500
        return cls("internal", f"{type(exc).__name__}: {exc}", status)

    def rebuild(self) -> Exception:
        if self.kind == "client":
            return OmniClientError(self.message, status_code=self.status_code, param=self.param)
        if self.kind == "restarting":
            return StageRestartingError(self.message)
        if self.kind == "dead":
            return EngineDeadError(self.message)
        return RuntimeError(self.message)


class CoreInfo(msgspec.Struct, array_like=True, gc=False):
    """What the API process reads of the stage, resolved once by the core at start-up."""

    model_class_name: str
    output_modality: str
    input_modalities: list[str]
    shape_rule: ShapeRule | None
    step_execution: bool
    world_size: int
    startup_s: dict[str, float] = {}
    """The slowest rank's seconds per start-up phase (the stage is ready when its last rank is)."""


class CoreReady(msgspec.Struct, tag="ready", array_like=True, gc=False):
    info: CoreInfo


class CoreInitFailed(msgspec.Struct, tag="init_failed", array_like=True, gc=False):
    error: str


class CorePartial(msgspec.Struct, tag="partial", array_like=True, gc=False):
    """Something a streamed request produced before its final output: kind "progress" ({step, total}),
    "video_chunk" ({video: uint8 frames, fps, frame_start}) or "partial_image"; always ahead of its final."""

    request_id: str
    kind: str
    data: dict[str, Any] = {}


class CoreFinal(msgspec.Struct, tag="final", array_like=True, gc=False):
    """A request's last message: its output (which may carry its own 4xx/5xx error), or the exception it
    failed with (dead or restarting workers, a request refused at admission)."""

    request_id: str
    output: DiffusionOutput | None = None
    error: CoreError | None = None


class CoreUtilityResult(msgspec.Struct, tag="utility_result", array_like=True, gc=False):
    call_id: int
    value: Any = None
    error: CoreError | None = None


class CoreState(msgspec.Struct, tag="state", array_like=True, gc=False):
    """The stage's health changed: restarting its workers (degraded), back, or dead."""

    restarting: bool
    dead: bool


CoreOutput = CoreReady | CoreInitFailed | CorePartial | CoreFinal | CoreUtilityResult | CoreState
