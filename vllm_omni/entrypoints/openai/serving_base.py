"""What every omni route shares: model checks, per-stage sampling params and one engine call that always
cleans up (a disconnected client or a cancelled handler aborts the request in the engine)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.capabilities import ModelCapabilities
from vllm_omni.entrypoints.openai.lora import ServedLoRAs
from vllm_omni.entrypoints.openai.metrics import OmniMetrics
from vllm_omni.entrypoints.openai.protocol.common import DIFFUSION_FIELD_NAMES, DiffusionFields, parse_size
from vllm_omni.errors import EngineDeadError, OmniClientError, OmniError, client_error_from_metadata
from vllm_omni.inputs.data import DiffusionLimits, OmniDiffusionSamplingParams
from vllm_omni.logger import init_logger
from vllm_omni.outputs import OmniRequestOutput

logger = init_logger(__name__)

ABORT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ServerLimits:
    """Per-request bounds of this server (its CLI flags), checked before anything is queued."""

    max_upload_bytes: int = 20 * 2**20
    max_request_outputs: int = 8
    max_input_image_pixels: int = 4096 * 4096
    """Decoded size of an input image (or video frame), read from its header before decoding where it can be
    (--max-input-image-pixels)."""
    max_input_audio_seconds: float = 600.0
    """Length of one decoded input audio (--max-input-audio-seconds)."""
    max_input_video_frames: int = 256
    """Frames of one decoded input video (--max-input-video-frames)."""
    diffusion: DiffusionLimits = field(default_factory=DiffusionLimits)


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def fail_fast(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """`stream` with its first chunk already produced, so that what it raises before sending anything (a dead or
    sleeping engine) is the HTTP status instead of a 200 stream carrying an error event."""
    first = await anext(stream)

    async def chained() -> AsyncIterator[str]:
        try:
            yield first
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    return chained()


async def prepend(first: list[Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for output in first:
        yield output
    async for output in rest:
        yield output


class OmniServingBase:
    """Holds the engine (an `AsyncOmni`) and the server-wide settings the feature handlers need."""

    def __init__(self, engine: Any, model_name: str, metrics: OmniMetrics, limits: ServerLimits,
                 loras: ServedLoRAs | None = None) -> None:
        self.engine = engine
        self.loras = loras or ServedLoRAs()
        """The adapters requests may name (`lora`); by default none, and `lora` is refused."""
        self.model_name = model_name
        self.metrics = metrics
        self.limits = limits
        self.capabilities: ModelCapabilities = engine.capabilities
        self.stage_types: list[str] = list(engine.stage_types)
        """For messages only; decisions ask `capabilities`."""
        self.output_modalities: set[str] = set(self.capabilities.output_modalities)
        self._aborts: set[asyncio.Task] = set()

    def check_model(self, model: str | None) -> None:
        if model not in (None, "", self.model_name):
            raise OmniClientError(f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                                  status_code=404, param="model")

    def require_output(self, modality: str, route: str) -> None:
        if modality not in self.output_modalities:
            raise OmniClientError(
                f"{route} needs a model that outputs {modality}; `{self.model_name}` outputs "
                f"{sorted(self.output_modalities)}",
                param="model",
            )

    def check_accepts_images(self, param: str) -> None:
        """Input images are refused before decoding when the model takes none (its declared capabilities)."""
        if not self.capabilities.accepts_image_input:
            raise OmniClientError(f"`{self.model_name}` does not take input images: it "
                                  f"{self.capabilities.describe()}", param=param)

    @staticmethod
    def log_user(request_id: str, user: str | None) -> None:
        """OpenAI's `user` (an end-user id for abuse tracking): logged with the request id, not used otherwise."""
        if user is not None:
            logger.info("request %s: user %r", request_id, user)

    # Sampling params -----------------------------------------------------------------------------

    def default_params(self, stage_id: int) -> Any:
        defaults = list(getattr(self.engine, "default_sampling_params_list", None) or [])
        return defaults[stage_id] if stage_id < len(defaults) else None

    def build_sampling_params_list(
        self,
        *,
        explicit: list[dict[str, Any]] | None = None,
        diffusion_fields: DiffusionFields | None = None,
        first_llm_params: Callable[[Any], Any] | None = None,
        n: int = 1,
    ) -> list[Any]:
        """One params object per stage. `explicit` (the request's `sampling_params_list`) wins; otherwise
        the first AR stage gets params derived from the request, diffusion stages get the request's
        diffusion fields over their defaults, and every other stage keeps its default."""
        if explicit is not None:
            return self._explicit_params(explicit, n)
        params: list[Any] = []
        seen_llm = False
        for stage_id, kind in enumerate(self.capabilities.stage_kinds):
            default = self.default_params(stage_id)
            if kind is StageKind.AR and not seen_llm and first_llm_params is not None:
                params.append(first_llm_params(default))
                seen_llm = True
            elif kind is StageKind.DIFFUSION:
                params.append(self.diffusion_params(default, diffusion_fields, stage_id))
            else:
                params.append(default)
        return params

    def _explicit_params(self, explicit: list[dict[str, Any]], n: int) -> list[Any]:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError

        if len(explicit) != len(self.stage_types):
            raise OmniClientError(
                f"sampling_params_list needs one entry per stage ({len(self.stage_types)}: {self.stage_types}), "
                f"got {len(explicit)}",
                param="sampling_params_list",
            )
        params: list[Any] = []
        for stage_id, (kind, entry) in enumerate(zip(self.capabilities.stage_kinds, explicit, strict=True)):
            param = f"sampling_params_list[{stage_id}]"
            if not isinstance(entry, dict):
                raise OmniClientError(f"{param} must be an object", param=param)
            if kind is StageKind.DIFFUSION:
                params.append(self._checked_diffusion_params(entry, param, stage_id))
                continue
            try:
                sp = SamplingParams(**entry)
            except (TypeError, ValueError, VLLMClientError) as exc:
                raise OmniClientError(f"{param}: {exc}", param=param) from exc
            # The answer has one choice per top-level `n`, and that field carries the rules for n > 1.
            if stage_id == self.capabilities.stage_kinds.index(StageKind.AR) and sp.n != n:
                raise OmniClientError(f"{param}.n must equal the request's n ({n}); set n at the top level",
                                      param=f"{param}.n")
            params.append(sp)
        return params

    def _checked_diffusion_params(self, entry: dict[str, Any], param: str, stage_id: int
                                  ) -> OmniDiffusionSamplingParams:
        sp = OmniDiffusionSamplingParams.from_dict(entry)
        self.check_diffusion_limits(sp, stage_id, f"{param}.")
        return sp

    def diffusion_params(self, default: Any, fields: DiffusionFields | None, stage_id: int
                         ) -> OmniDiffusionSamplingParams:
        base = default if isinstance(default, OmniDiffusionSamplingParams) else OmniDiffusionSamplingParams()
        if fields is None:
            return base.clone()
        updates = fields.model_dump(include=set(DIFFUSION_FIELD_NAMES - {"size", "cfg_scale"}), exclude_none=True)
        width, height = parse_size(fields.size)
        if width is not None:
            updates.setdefault("width", width)
            updates.setdefault("height", height)
        sp = dataclasses.replace(base.clone(), **updates)
        self.check_diffusion_limits(sp, stage_id, size_field="size" if fields.size else None)
        return sp

    def check_diffusion_limits(self, sp: OmniDiffusionSamplingParams, stage_id: int, prefix: str = "",
                               size_field: str | None = None) -> None:
        """The server's bounds, then the sizes the stage's pipeline makes (its `ShapeRule`): everything that
        would fail in the worker fails here, before a request or job exists."""
        self.check_num_outputs(sp.num_outputs_per_prompt, f"{prefix}num_outputs_per_prompt")
        sp.check_limits(self.limits.diffusion, prefix)
        self.loras.resolve(sp, prefix)
        rule = self.capabilities.shape_rule(stage_id)
        if rule is not None:
            rule.check(sp, prefix, size_field)

    def check_num_outputs(self, n: int, param: str) -> None:
        if n > self.limits.max_request_outputs:
            raise OmniClientError(
                f"{param}={n} is more than this server allows per request ({self.limits.max_request_outputs}; "
                "see --max-request-outputs)",
                param=param,
            )

    # Engine calls --------------------------------------------------------------------------------

    async def generate(self, prompt: Any, request_id: str, sampling_params_list: list[Any],
                       output_modalities: list[str] | None = None) -> AsyncIterator[OmniRequestOutput]:
        """`engine.generate`, plus: failed outputs raise their error, and leaving early aborts the request."""
        if getattr(self.engine, "is_dead", False):
            raise EngineDeadError()
        if getattr(self.engine, "is_sleeping", False):  # admission is closed: fail now instead of waiting
            raise OmniError("the server is sleeping; POST /v1/omni/wakeup first", status_code=503)
        completed = False
        outcome = "aborted"
        self.metrics.request_started()
        try:
            async for output in self.engine.generate(prompt, request_id, sampling_params_list,
                                                     output_modalities=output_modalities):
                if output.error is not None:
                    outcome = "error"
                    raise client_error_from_metadata(output.error, status_code=output.error_status_code,
                                                     error_type=None)
                if output.finished:
                    self.metrics.observe_stages(output.stage_durations)
                    self.metrics.observe_cache(output.cache)
                    self.metrics.diffusion_steps.observe(output.step_stats, output.stage_id)
                    self.metrics.diffusion_steps.observe_compiles(output.stage_id, output.compile_stats)
                yield output
            completed = True
            outcome = "finished"
        except Exception:  # the engine failed it (a client that left cancels: BaseException, "aborted")
            outcome = "error"
            raise
        finally:
            if completed:
                self.metrics.request_ended(outcome)
            else:
                # A task of its own: a cancelled handler (client gone) re-raises at every await, but the
                # abort must still reach the engine, and the running gauge drops only once it has.
                task = asyncio.ensure_future(self._abort(request_id, outcome))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)
                await asyncio.shield(task)

    async def generate_final(self, prompt: Any, request_id: str, sampling_params_list: list[Any],
                             output_modalities: list[str] | None = None) -> list[OmniRequestOutput]:
        """Run to completion; returns the last output of every stage that reported one, in stage order."""
        last: dict[int, OmniRequestOutput] = {}
        async for output in self.generate(prompt, request_id, sampling_params_list, output_modalities):
            last[output.stage_id] = output
        if not last:
            raise client_error_from_metadata("No output generated from AsyncOmni", status_code=500, error_type=None)
        return [last[stage_id] for stage_id in sorted(last)]

    async def _abort(self, request_id: str, outcome: str) -> None:
        try:
            await asyncio.wait_for(maybe_await(self.engine.abort(request_id)), ABORT_TIMEOUT_S)
        except Exception:
            logger.warning("Abort of request %s did not complete cleanly", request_id, exc_info=True)
        finally:
            self.metrics.request_ended(outcome)
