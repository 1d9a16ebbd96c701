"""DIFFUSION stage: a diffusion core process (`diffusion/core/`) behind the stage interface.

The core owns the stage's scheduler and workers; this client only sends requests and reads what comes back, on
the caller's event loop (`DiffusionCoreClient`). A request whose params set `stream_partial_outputs` also yields
its partials (denoise progress, decoded video chunks, partial images) as unfinished outputs before the final one,
each as it arrives. A streamed clip is not joined here: its chunks went out as they came, and its final output
says only how many frames they made (`{"streamed_frames": T, "fps"}`); a caller that wants the whole clip joins
the chunks it read (`video_utils.join_streamed_video`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from vllm_omni.catalog.shapes import ShapeRule
from vllm_omni.catalog.spec import Modality
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.diffusion.core.client import DiffusionCoreClient, RequestStream
from vllm_omni.diffusion.core.prestart import PrestartedCore
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.engine.spawn_env import spawn_environ
from vllm_omni.engine.stage_client import StageClientBase
from vllm_omni.errors import EngineDeadError, client_error_from_metadata
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.logger import init_logger
from vllm_omni.outputs import OmniRequestOutput

logger = init_logger(__name__)

_ABORT_WAIT_S = 3.0
"""How long an abort waits for the workers to leave the request: well inside the frontend's 10 s, and short
enough that a SIGTERM (3 s grace, this, then the core's shutdown) still ends within 15 s."""


class StageDiffusionClient(StageClientBase):
    kind = StageKind.DIFFUSION

    def __init__(self, config, replica_id: int = 0, prestarted_core: PrestartedCore | None = None) -> None:
        super().__init__(config, replica_id)
        self._prestarted_core = prestarted_core
        """A core process `vllm serve` forked ahead; the first replica to start takes it (`prestart.py`)."""
        self._core: DiffusionCoreClient | None = None
        self._engine_dead = False

    async def start(self) -> None:
        od_config = self.config.make_od_config()
        if od_config.ray is not None:  # a bad address or a placement no node has: one line, before any process
            from vllm_omni.diffusion.executor.ray_executor import check_placement

            await asyncio.to_thread(check_placement, od_config)
        self._core = DiffusionCoreClient(od_config, self._prestarted_core)
        try:
            # The core and its workers take this replica's devices (they keep the environment the core starts
            # with); other stages start theirs once the core's process exists.
            async with spawn_environ(self.config.spawn_env(self.replica_id)):
                self._core.launch()
            info = await self._core.wait_ready(self.config.stage_init_timeout)
        except BaseException:
            # Given up (another stage failed, a timeout): the core and its workers must not outlive the start.
            self._core.shutdown()
            raise
        self.startup_phases = dict(info.startup_s)

    def on_loop(self) -> None:
        self._core.on_loop()

    @property
    def output_modality(self) -> str:
        return self.config.final_output_type or self._core.info.output_modality

    @property
    def input_modalities(self) -> frozenset[Modality]:
        return frozenset(self._core.info.input_modalities)

    @property
    def shape_rule(self) -> ShapeRule | None:
        return self._core.info.shape_rule

    def default_sampling_params(self) -> OmniDiffusionSamplingParams:
        return OmniDiffusionSamplingParams.from_dict(dict(self.config.default_sampling_params))

    async def add_request_async(self, request_id: str, prompt: Any, sampling_params: Any) -> RequestStream:
        """Send one request to the core; its outputs arrive on the returned stream."""
        if self.is_dead:
            raise EngineDeadError(f"{self.name}: diffusion engine is dead")
        # Clone now: the caller may reuse one params object for many requests.
        params = OmniDiffusionSamplingParams.from_params(sampling_params).clone()
        request = OmniDiffusionRequest(prompt=prompt, sampling_params=params, request_id=request_id)
        return await self._core.add_request(request, stream=params.stream_partial_outputs)

    async def generate(self, request_id: str, prompt: Any, sampling_params: Any) -> AsyncIterator[OmniRequestOutput]:
        start = time.perf_counter()
        params = OmniDiffusionSamplingParams.from_params(sampling_params)
        stream = await self.add_request_async(request_id, prompt, params)
        try:
            async for partial in stream.partials():
                yield self._partial_output(request_id, partial)
            final = await stream.final()
        finally:
            self._core.release(request_id)
        if final.error is not None:
            error = final.error.rebuild()
            if isinstance(error, EngineDeadError):
                self._engine_dead = True
            raise error
        result = final.output
        if result.error is not None:
            raise client_error_from_metadata(
                result.error, status_code=result.error_status_code, error_type=result.error_type,
                param=result.error_param,
            )
        yield self._to_output(request_id, result, time.perf_counter() - start)

    def _partial_output(self, request_id: str, partial: Any) -> OmniRequestOutput:
        """`{"video_chunk": frames, "fps", "frame_start"}` or `{"progress": {"step", "total"}}`, unfinished."""
        out = OmniRequestOutput(
            request_id=request_id, finished=False, stage_id=self.stage_id, final_output_type=self.output_modality
        )
        data = dict(partial.data)
        if partial.kind == "video_chunk":
            out.multimodal_output = {"video_chunk": data.pop("video"), **data}
        else:
            out.multimodal_output = {partial.kind: data}
        return out

    def _to_output(self, request_id: str, result: Any, elapsed: float) -> OmniRequestOutput:
        modality = self.output_modality
        out = OmniRequestOutput(
            request_id=request_id,
            finished=True,
            stage_id=self.stage_id,
            final_output_type=modality,
            peak_memory_mb=result.peak_memory_mb,
            cache=result.extra.get("cache"),
            step_stats=result.step_stats,
            compile_stats=result.compile_stats,
        )
        if isinstance(result.output, dict):
            out.multimodal_output = dict(result.output)
        elif modality == "image":
            out.images = list(result.output or [])
        else:
            out.multimodal_output = {modality: result.output}
        out.stage_durations = self.stage_durations(elapsed, result.stage_durations)
        return out

    async def abort(self, request_ids: list[str]) -> None:
        """Returns once the workers stopped running the requests (or after `_ABORT_WAIT_S`), so that what
        the frontend counts as running is what the workers run."""
        if self.is_dead:
            return
        if not await self._core.abort(list(request_ids), _ABORT_WAIT_S):
            logger.warning(
                "%s: aborted request(s) %s still ran on the workers after %.0f s", self.name, request_ids, _ABORT_WAIT_S
            )

    async def collective_rpc_async(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return await self._core.collective_rpc(method, tuple(args), kwargs, timeout)

    @property
    def is_dead(self) -> bool:
        return self._engine_dead or (self._core is not None and self._core.is_dead)

    @property
    def is_restarting(self) -> bool:
        return self._core is not None and self._core.restarting

    def shutdown(self) -> None:
        if self._core is not None:
            self._core.shutdown()
