"""What a model family declares about itself: one `ModelSpec` per `vllm_omni/models/<family>/spec.py`.

A spec holds only names ("module:attr" strings) and plain data, so reading it imports no torch: the server,
the config resolver and the registry answer "which pipeline, which stages, what can it do" without loading a
model. Everything a family implements (pipelines, stage-input processors, output collectors, vLLM model
classes, tiny checkpoint builders) is reached through its spec.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Literal

Modality = Literal["text", "image", "video", "audio"]


def import_target(target: str) -> Any:
    """Resolve a "module:attr" string."""
    module_name, sep, attr = target.partition(":")
    if not sep or not attr:
        raise ValueError(f"{target!r} is not a 'module:attr' name")
    return getattr(importlib.import_module(module_name), attr)


@dataclass(frozen=True)
class DiffusionPipelineEntry:
    """One diffusers `_class_name` a family serves on the diffusion runtime."""

    target: str
    """Our pipeline class as "module:Class"."""
    output_modality: Modality
    input_modalities: frozenset[Modality] = frozenset({"text"})
    """"image" here: the pipeline conditions on an input image (edits, image-to-video)."""
    max_prompt_tokens: int | None = None
    """The most prompt tokens its text encoder reads (longer prompts are refused before queuing)."""
    prompt_tokenizer: str = "tokenizer"
    """The checkpoint subfolder of the tokenizer those tokens are counted with."""
    shape_rule: str | None = None
    """"module:fn" taking the checkpoint directory and returning its `ShapeRule` (catalog/shapes.py) from the
    config files alone: which sizes the pipeline makes, checked in the API process before queuing."""


@dataclass(frozen=True)
class ModelSpec:
    family: str
    description: str
    architectures: tuple[str, ...] = ()
    """HF `architectures` entries / `model_type` values whose stage topology this family defines."""
    topology: str | None = None
    """"module:fn" returning the family's `PipelineConfig` (multi-stage models)."""
    input_modalities: frozenset[Modality] = frozenset({"text"})
    """What a request to the topology may carry (multi-stage models)."""
    output_modalities: frozenset[Modality] = frozenset({"text"})
    """What the topology's final stages produce (multi-stage models)."""
    diffusion_pipelines: dict[str, DiffusionPipelineEntry] = field(default_factory=dict)
    ar_models: dict[str, str] = field(default_factory=dict)
    """vLLM architecture name -> "module:Class" registered with vLLM's `ModelRegistry`."""
    hf_configs: dict[str, str] = field(default_factory=dict)
    """HF `model_type` -> "module:ConfigClass" registered with transformers' `AutoConfig` (checkpoints whose
    config class transformers does not ship), in every vLLM process, by our plugin."""
    stage_input_processors: dict[str, str] = field(default_factory=dict)
    """Name used in a pipeline's `input_processor:` -> "module:fn"."""
    output_collectors: dict[str, str] = field(default_factory=dict)
    """Name used in a pipeline's `output_collector:` -> "module:fn"."""
    tiny: dict[str, str] = field(default_factory=dict)
    """`tiny/<name>` -> "module:builder" (a function decorated with `tiny_checkpoint`)."""
