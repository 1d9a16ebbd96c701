"""What `Omni` and `AsyncOmni` share: resolve the config once, start the engine, normalize per-stage params."""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any

from vllm_omni.config.omni_config import StageConfigFactory
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.diffusion.core.prestart import PrestartedCore
from vllm_omni.engine.async_omni_engine import AsyncOmniEngine
from vllm_omni.engine.capabilities import ModelCapabilities
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


class OmniBase:
    def __init__(self, model: str, *, prestarted_core: PrestartedCore | None = None, **kwargs: Any) -> None:
        """`prestarted_core`: a diffusion core process forked ahead for this engine (`vllm serve` does)."""
        self._name = self.__class__.__name__
        self.model_name = model
        start = time.perf_counter()
        self.config = StageConfigFactory.create_from_model(model, **kwargs)
        logger.info("[%s] resolved %s into pipeline %r (%s) in %.2f s", self._name, model,
                    self.config.pipeline_name, self.config.stage_types, time.perf_counter() - start)
        self.engine = AsyncOmniEngine(self.config, prestarted_core=prestarted_core)
        self.default_sampling_params_list = [m["default_sampling_params"] for m in self.engine.stage_metadata]

    @property
    def stage_kinds(self) -> list[StageKind]:
        return [m["stage_kind"] for m in self.engine.stage_metadata]

    @property
    def stage_types(self) -> list[str]:
        """The stage kinds' user-visible names ("llm", "generation", "diffusion")."""
        return [kind.stage_type for kind in self.stage_kinds]

    @property
    def capabilities(self) -> ModelCapabilities:
        """What the model can do (input / output modalities, edits, audio), decided once at start-up."""
        return self.engine.capabilities

    @property
    def output_modalities(self) -> set[str]:
        return {m["output_modality"] for m in self.engine.stage_metadata if m["final_output"]}

    @property
    def num_stages(self) -> int:
        return len(self.engine.stage_metadata)

    @property
    def vllm_config(self):
        """vLLM config of the first AR stage (None for pipelines without one)."""
        return next((c for c in self.engine.stage_vllm_configs if c is not None), None)

    @property
    def model_config(self):
        return self.vllm_config.model_config if self.vllm_config is not None else None

    def get_tokenizer(self):
        for client in self.engine.stage_clients:
            if client.kind is StageKind.AR:
                return client.get_tokenizer()
        raise ValueError(f"{self.model_name} has no AR stage, hence no tokenizer")

    def _resolve_sampling_params(self, sampling_params_list: Any) -> list[Any]:
        """One params object per stage; None entries take the stage default; single params fill their type."""
        n = self.num_stages
        if sampling_params_list is None:
            given: list[Any] = [None] * n
        elif isinstance(sampling_params_list, list | tuple):
            given = list(sampling_params_list)
        else:
            given = self._place_single(sampling_params_list)
        if len(given) != n:
            raise OmniClientError(f"sampling_params_list has {len(given)} entries but the pipeline has {n} stages "
                                  f"{self.stage_types}", param="sampling_params_list")
        return [self._stage_params(i, p) for i, p in enumerate(given)]

    def _place_single(self, params: Any) -> list[Any]:
        wanted = StageKind.DIFFUSION if isinstance(params, OmniDiffusionSamplingParams) else StageKind.AR
        if self.num_stages == 1:
            return [params]
        return [params if kind is wanted else None for kind in self.stage_kinds]

    def _stage_params(self, stage_id: int, params: Any) -> Any:
        if params is None:
            return copy.deepcopy(self.default_sampling_params_list[stage_id])
        if self.stage_kinds[stage_id] is StageKind.DIFFUSION:
            return OmniDiffusionSamplingParams.from_params(params)
        if isinstance(params, dict):
            from vllm import SamplingParams

            try:
                return SamplingParams(**params)
            except TypeError as e:
                raise OmniClientError(f"stage {stage_id}: invalid sampling params: {e}",
                                      param="sampling_params_list") from e
        return params

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    async def close_async(self) -> None:
        """`close` on the loop that drives the engine: the stages stop side by side while it keeps running."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            await engine.shutdown_async()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
