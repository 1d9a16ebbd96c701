"""`OmniEngineArgs`: vLLM's `EngineArgs` plus the knobs of the omni control plane and diffusion stages.

The CLI (`vllm serve M --omni`) parses these; `omni_kwargs_from_cli()` turns the flags a user actually set into
the `**engine_kwargs` of `AsyncOmni(model, ...)`, so the Python API and the CLI share one set of names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from vllm.config.utils import get_attr_docs
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

_FRONTEND_ONLY = frozenset({"model", "omni", "served_model_name"})
"""Engine-args fields the HTTP server consumes itself; they never reach the stages."""
_METAVARS = {int: "N", float: "X", str: "NAME", dict: "JSON"}


def _json_object(flag: str):
    """argparse `type=` that parses a JSON object and names the flag when it is not one."""

    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object: {exc}") from exc
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, got {type(value).__name__}")
        return value

    return parse


def attr_help(*classes: type) -> dict[str, str]:
    """Attribute docstrings of `classes` as one-line argparse help; an earlier class wins on a shared name."""
    docs: dict[str, str] = {}
    for cls in reversed(classes):
        docs.update({name: " ".join(doc.split()).replace("%", "%%") for name, doc in get_attr_docs(cls).items()})
    return docs


def add_dataclass_args(group, cls: type, names: list[str], docs: dict[str, str],
                       choices: dict[str, list[str]] | None = None) -> None:
    """One `--flag` per field in `names`: type, default and choices from the field, help from `docs`.

    bool fields are switches; dict fields take a JSON object; `Literal` fields (or `choices`) are choices.
    """
    module_globals = vars(sys.modules[cls.__module__])
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        flag = "--" + name.replace("_", "-")
        field = by_name[name]
        # Only these fields' annotations are evaluated (postponed annotations, as typing.get_type_hints does).
        hint = eval(field.type, module_globals) if isinstance(field.type, str) else field.type
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        base = next(t for t in options if t is not type(None))
        kwargs: dict[str, Any] = {"default": field.default, "help": docs[name]}
        if base is bool:  # a switch; one that defaults to on also gets its --no- form
            kwargs["action"] = argparse.BooleanOptionalAction if field.default is True else "store_true"
        elif typing.get_origin(base) is Literal:
            kwargs["choices"] = list(typing.get_args(base))
        elif typing.get_origin(base) is dict:
            kwargs.update(type=_json_object(flag), metavar="JSON")
        else:
            kwargs.update(type=base, metavar=_METAVARS[base])
        if choices and name in choices:
            kwargs.pop("metavar", None)
            kwargs["choices"] = choices[name]
        group.add_argument(flag, **kwargs)


@dataclass
class OmniEngineArgs(EngineArgs):
    """Engine arguments of a vllm-omni pipeline (all stages).

    Fields without a docstring here are diffusion-stage knobs: their help is the docstring of the
    `OmniDiffusionConfig` / `DiffusionParallelConfig` field they set, so it is written once.
    """

    omni: bool = False
    """Serve through vllm-omni (what makes `vllm` hand over)."""
    stage_overrides: dict[str, dict[str, Any]] | None = None
    """Per-stage engine args keyed by stage id, e.g. {"0": {"max_num_seqs": 2}}; they win over global flags."""
    pipeline_config: str | None = None
    """Pipeline config YAML (the stage graph: stages, their models, edges, final outputs) instead of the
    model's own topology; serves any multi-stage pipeline `Omni(pipeline_config=...)` runs offline."""
    deploy_config: str | None = None
    """Deploy config YAML (placement, devices, deploy-time defaults); never changes the stage graph."""
    stage_init_timeout: float | None = None
    """Seconds one stage may take to start; None = the control plane's default."""
    init_timeout: float | None = None
    """Seconds the whole pipeline may take to start; None = the control plane's default."""
    worker_backend: Literal["mp", "ray"] | None = None
    """Where stages' workers run: mp = processes of this host; ray = Ray actors placed on a Ray cluster by the
    deploy config's `stages[].placement`. None = the deploy config's (mp by default)."""
    ray_address: str | None = None
    """--worker-backend ray: the Ray cluster to join ("auto", host:port); None = the deploy config's, else
    $RAY_ADDRESS, else a cluster started on this host."""
    diffusion_attention_backend: str | None = None
    torch_num_threads: int | None = None
    request_batch_max_wait_ms: float = 0.0
    step_execution: bool = False
    diffusion_max_tokens_per_forward: int | None = 16384
    diffusion_scheduler_policy: Literal["fcfs", "priority", "slo"] = "fcfs"
    default_deadline_ms: float = 60000.0
    slo_starvation_factor: float = 4.0
    slo_deadline_factor: float = 2.0
    slo_admission_control: bool = False
    slo_admission_min_accept: float = 0.9
    max_paused_states: int = 4
    fa_deterministic: bool = False
    diffusers_load_kwargs: dict[str, Any] | None = None
    use_diffusers_adapter: bool = False
    diffusion_warmup_shapes: str | None = None
    diffusion_compile_cache_dir: str | None = None
    model_class_name: str | None = None
    cache_backend: Literal["cache_dit", "tea_cache", "none"] | None = None
    cache_config: dict[str, Any] | None = None
    num_gpus: int | None = None
    sequence_parallel_size: int | None = None
    ulysses_degree: int | None = None
    ring_degree: int | None = None
    allgather_degree: int | None = None
    ulysses_mode: Literal["strict", "advanced_uaa"] | None = None
    cfg_parallel_size: int | None = None
    vae_patch_parallel_size: int | None = None
    diffusion_memory_budget_gb: float | None = None
    enable_layerwise_offload: bool = False
    offload_resident_layers: int = 0
    offload_prefetch_layers: int = 1
    enable_cpu_offload: bool = False
    enable_distributed_layerwise_offload: bool = False
    dlo_use_allgather: bool = True
    dlo_resident_layers: int = 0
    max_stage_restarts: int | None = None
    """Times a stage re-creates what died (diffusion workers, an AR stage's EngineCore) before it is dead;
    None = the stage's default (3)."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = AsyncEngineArgs.add_cli_args(parser)
        return cls._add_omni_specific_args(parser)

    @classmethod
    def _add_omni_specific_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        from vllm_omni.diffusion.attention.selector import available_backends
        from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig

        group = parser.add_argument_group(title="OmniConfig", description="vllm-omni pipeline options.")
        own = [f.name for f in dataclasses.fields(cls) if f.name in OMNI_ARG_NAMES]
        docs = attr_help(cls, OmniDiffusionConfig, DiffusionParallelConfig)
        add_dataclass_args(group, cls, own, docs, {"diffusion_attention_backend": available_backends()})
        # Unset unless given: a diffusion stage resolves an unset value by its device (compiled on CUDA, eager on
        # CPU), so only a flag the user gave reaches the stages.
        parser.set_defaults(enforce_eager=None)
        return parser

    @classmethod
    def omni_kwargs_from_cli(cls, args: argparse.Namespace, defaults: argparse.Namespace) -> dict[str, Any]:
        """The engine flags set differently from the parser's `defaults`: what `AsyncOmni(model, **kw)` takes.

        Works on the parsed namespaces (no `EngineArgs.__post_init__`, which would resolve the model name
        through the hub), and passes on only what the user changed, so stage defaults stay in charge.
        """
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in _FRONTEND_ONLY or not hasattr(args, f.name):
                continue
            value = getattr(args, f.name)
            if value != getattr(defaults, f.name, f.default):
                kwargs[f.name] = value
        return kwargs


OMNI_ARG_NAMES = frozenset(f.name for f in dataclasses.fields(OmniEngineArgs)) - {
    f.name for f in dataclasses.fields(EngineArgs)}
"""The flags vllm-omni adds to vLLM's engine flags (group OmniConfig)."""
