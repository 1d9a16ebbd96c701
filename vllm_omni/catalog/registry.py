"""The one model registry: model families as lazy "module:SPEC" strings, resolved on first use.

Every lookup a model needs goes through here: which native pipeline serves a diffusers `_class_name`, which
stage topology an HF architecture has, a pipeline's stage-input processors and output collectors, the AR model
classes vLLM learns through our plugin, and the built-in `tiny/<name>` checkpoints. Reading a spec imports no
torch (see `spec.py`); the targets it names are imported only when used.

Extension points for users (the same registry): `register_pipeline(*architectures)` for a stage topology,
`register_stage_input_processor(name)` / `register_output_collector(name)` for the hooks a topology names, and
`register_family(spec)` for a whole family.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

from vllm_omni.catalog.spec import DiffusionPipelineEntry, Modality, ModelSpec, import_target

_BUILTIN_FAMILIES: dict[str, str] = {
    "qwen_image": "vllm_omni.models.qwen_image.spec:SPEC",
    "flux": "vllm_omni.models.flux.spec:SPEC",
    "z_image": "vllm_omni.models.z_image.spec:SPEC",
    "qwen_image_21": "vllm_omni.models.qwen_image_21.spec:SPEC",
    "hunyuan_image_21": "vllm_omni.models.hunyuan_image_21.spec:SPEC",
    "flux2": "vllm_omni.models.flux2.spec:SPEC",
    "wan": "vllm_omni.models.wan.spec:SPEC",
    "ltx2": "vllm_omni.models.ltx2.spec:SPEC",
    "qwen3_omni": "vllm_omni.models.qwen3_omni.spec:SPEC",
    "qwen3_tts": "vllm_omni.models.qwen3_tts.spec:SPEC",
    "llm": "vllm_omni.models.llm.spec:SPEC",
}
DIFFUSERS_ADAPTER = "vllm_omni.models.diffusers_adapter.pipeline:DiffusersAdapterPipeline"
"""Serves every diffusers pipeline no family claims."""


class OmniModelRegistry:
    def __init__(self, families: dict[str, str]) -> None:
        self._entries: dict[str, str | ModelSpec] = dict(families)
        self._registered: list[ModelSpec | str] = []
        self._user = ModelSpec(family="user", description="registered at run time")
        self._entries["user"] = self._user

    # --- families -------------------------------------------------------------------------------------------

    def register_family(self, spec: ModelSpec | str) -> None:
        name = spec.family if isinstance(spec, ModelSpec) else spec
        self._entries[name] = spec
        self._registered.append(spec)

    def registered_families(self) -> list[ModelSpec | str]:
        """What `register_family` added in this process, as given: a process the engine starts (the diffusion
        core) registers them again before it resolves a pipeline."""
        return list(self._registered)

    def specs(self) -> Iterator[ModelSpec]:
        for name, entry in list(self._entries.items()):
            if isinstance(entry, str):
                entry = self._entries[name] = import_target(entry)
            yield entry

    def spec(self, family: str) -> ModelSpec:
        for spec in self.specs():
            if spec.family == family:
                return spec
        raise KeyError(f"unknown model family {family!r}")

    # --- diffusion pipelines --------------------------------------------------------------------------------

    def diffusion_entry(self, class_name: str) -> DiffusionPipelineEntry | None:
        for spec in self.specs():
            if class_name in spec.diffusion_pipelines:
                return spec.diffusion_pipelines[class_name]
        return None

    def pipeline_class_path(self, class_name: str, use_diffusers_adapter: bool = False) -> str:
        """A "module:Class" name (a custom pipeline) is used as is; unknown diffusers names get the adapter."""
        if ":" in class_name and not use_diffusers_adapter:
            return class_name
        entry = None if use_diffusers_adapter else self.diffusion_entry(class_name)
        return entry.target if entry else DIFFUSERS_ADAPTER

    def load_pipeline_class(self, class_name: str, use_diffusers_adapter: bool = False) -> type:
        return import_target(self.pipeline_class_path(class_name, use_diffusers_adapter))

    def output_modality(self, class_name: str) -> Modality:
        """From the family spec, a custom pipeline's `output_modality`, or the diffusers pipeline's declared
        output dataclass (`frames` -> video, `audios` -> audio, else image)."""
        entry = self.diffusion_entry(class_name)
        if entry is not None:
            return entry.output_modality
        if ":" in class_name:
            return getattr(import_target(class_name), "output_modality", "image")
        return _diffusers_output_modality(class_name)

    def input_modalities(self, class_name: str) -> frozenset[Modality]:
        entry = self.diffusion_entry(class_name)
        if entry is not None:
            return entry.input_modalities
        if ":" in class_name:
            return frozenset(getattr(import_target(class_name), "input_modalities", {"text"}))
        return frozenset({"text", "image"})  # a diffusers pipeline takes `image` when its signature does

    # --- stage topologies and their hooks -------------------------------------------------------------------

    def topology_for(self, keys: list[str]) -> Callable[[], Any] | None:
        """The `PipelineConfig` factory for the first of `keys` (HF architectures, then model_type) a family
        (or `register_pipeline`) claims."""
        for key in keys:
            for spec in self.specs():
                if key in spec.architectures and spec.topology is not None:
                    return _resolve(spec.topology)
        return None

    def family_for(self, keys: list[str]) -> ModelSpec | None:
        for key in keys:
            for spec in self.specs():
                if key in spec.architectures:
                    return spec
        return None

    def stage_input_processor(self, name: str) -> Callable[..., Any]:
        return self._hook("stage_input_processors", name, "stage input processor")

    def output_collector(self, name: str) -> Callable[..., Any]:
        return self._hook("output_collectors", name, "output collector")

    def _hook(self, kind: str, name: str, label: str) -> Callable[..., Any]:
        if ":" in name:
            return import_target(name)
        known: list[str] = []
        for spec in self.specs():
            table = getattr(spec, kind)
            if name in table:
                return _resolve(table[name])
            known.extend(table)
        raise ValueError(f"unknown {label} {name!r}; known: {sorted(known)}")

    def ar_models(self) -> dict[str, str]:
        return {arch: target for spec in self.specs() for arch, target in spec.ar_models.items()}

    def hf_configs(self) -> dict[str, str]:
        return {model_type: target for spec in self.specs() for model_type, target in spec.hf_configs.items()}

    # --- tiny checkpoints -----------------------------------------------------------------------------------

    def tiny_builder(self, name: str) -> Callable[..., None]:
        for spec in self.specs():
            if name in spec.tiny:
                return _resolve(spec.tiny[name])
        raise KeyError(f"unknown tiny model {name!r}; available: {self.tiny_names()}")

    def tiny_names(self) -> list[str]:
        return sorted(name for spec in self.specs() for name in spec.tiny)

    # --- user registration ----------------------------------------------------------------------------------

    def register_pipeline(self, *keys: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
        """Register a stage topology (`() -> PipelineConfig`) for HF `architectures` entries or `model_type`s.
        It wins over a built-in family's topology for the same key."""

        def decorator(factory: Callable[[], Any]) -> Callable[[], Any]:
            spec = ModelSpec(family=f"user:{factory.__qualname__}", description=factory.__doc__ or "",
                             architectures=tuple(keys), topology=factory)  # type: ignore[arg-type]
            self._entries = {spec.family: spec, **self._entries}
            return factory

        return decorator

    def register_stage_input_processor(self, name: str) -> Callable[[Callable], Callable]:
        return self._register_hook(self._user.stage_input_processors, name)

    def register_output_collector(self, name: str) -> Callable[[Callable], Callable]:
        return self._register_hook(self._user.output_collectors, name)

    @staticmethod
    def _register_hook(table: dict[str, Any], name: str) -> Callable[[Callable], Callable]:
        def decorator(fn: Callable) -> Callable:
            table[name] = fn
            return fn

        return decorator


def _resolve(target: str | Callable[..., Any]) -> Any:
    return import_target(target) if isinstance(target, str) else target


def _diffusers_output_modality(class_name: str) -> Modality:
    import diffusers
    from diffusers.utils import BaseOutput

    cls = getattr(diffusers, class_name, None)
    if cls is None:
        return "image"
    module = sys.modules[cls.__module__]
    fields = {name for value in vars(module).values()
              if isinstance(value, type) and issubclass(value, BaseOutput) and value is not BaseOutput
              for name in getattr(value, "__dataclass_fields__", {})}
    if "frames" in fields or "videos" in fields:
        return "video"
    if "audios" in fields or "audio" in fields:
        return "audio"
    return "image"


MODEL_REGISTRY = OmniModelRegistry(_BUILTIN_FAMILIES)
register_pipeline = MODEL_REGISTRY.register_pipeline
register_stage_input_processor = MODEL_REGISTRY.register_stage_input_processor
register_output_collector = MODEL_REGISTRY.register_output_collector
register_family = MODEL_REGISTRY.register_family
