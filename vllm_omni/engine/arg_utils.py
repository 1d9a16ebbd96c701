"""`OmniEngineArgs`: vLLM's `EngineArgs` plus the knobs of the omni control plane and diffusion stages.

The CLI (`vllm serve M --omni`) parses these; `to_omni_kwargs()` turns the flags a user actually set into
the `**engine_kwargs` of `AsyncOmni(model, ...)`, so the Python API and the CLI share one set of names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

DIFFUSION_ATTENTION_BACKENDS = ("TORCH_SDPA", "FLASH_ATTN", "FLASHINFER_ATTN", "CUDNN_ATTN", "SAGE_ATTN")
CACHE_BACKENDS = ("cache_dit", "none")
_FRONTEND_ONLY = frozenset({"model", "omni", "served_model_name"})
"""Engine-args fields the HTTP server consumes itself; they never reach the stages."""


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


@dataclass
class OmniEngineArgs(EngineArgs):
    """Engine arguments of a vllm-omni pipeline (all stages)."""

    omni: bool = False
    """Serve through vllm-omni (set by `vllm serve ... --omni`)."""
    stage_overrides: dict[str, dict[str, Any]] | None = None
    """Per-stage overrides keyed by stage id, e.g. {"0": {"max_num_seqs": 2}}; they win over global flags."""
    deploy_config: str | None = None
    """Deploy config YAML (placement, devices, deploy-time defaults); never changes the stage graph."""
    diffusion_attention_backend: str | None = None
    """Attention backend of diffusion stages; None = env DIFFUSION_ATTENTION_BACKEND or auto."""
    request_batch_max_wait_ms: float = 0.0
    """How long a diffusion scheduler waits for compatible requests to fill a batch."""
    cache_backend: str | None = None
    """Diffusion cache acceleration backend (cache_dit | none)."""
    cache_config: dict[str, Any] | None = None
    """Cache backend settings as JSON."""
    fa_deterministic: bool = False
    """Deterministic FlashAttention on the dense diffusion path (slower; for accuracy CI)."""
    diffusers_load_kwargs: dict[str, Any] | None = None
    """Extra kwargs for diffusers `from_pretrained` (generic adapter path)."""
    use_diffusers_adapter: bool = False
    """Run diffusion models through the generic diffusers adapter even when a native pipeline exists."""
    model_class_name: str | None = None
    """Diffusion pipeline class instead of `_class_name` of model_index.json (e.g. `WanImageToVideoPipeline`
    for Wan2.2-TI2V-5B image-to-video, or a `module:Class` path)."""
    num_gpus: int | None = None
    """Devices per diffusion stage (None = the stage's default)."""
    stage_init_timeout: float | None = None
    """Seconds one stage may take to start; None = the control plane's default."""
    init_timeout: float | None = None
    """Seconds the whole pipeline may take to start; None = the control plane's default."""
    max_stage_restarts: int | None = None
    """Times a diffusion stage replaces workers that died before it is dead; None = the stage's default (3)."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = AsyncEngineArgs.add_cli_args(parser)
        return cls._add_omni_specific_args(parser)

    @staticmethod
    def _add_omni_specific_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        group = parser.add_argument_group(title="OmniConfig", description="vllm-omni pipeline options.")
        group.add_argument("--omni", action="store_true", help="Serve through vllm-omni.")
        group.add_argument(
            "--stage-overrides",
            type=_json_object("--stage-overrides"),
            default=None,
            help='Per-stage overrides as JSON keyed by stage id, e.g. \'{"0": {"max_num_seqs": 2}}\'.',
        )
        group.add_argument("--deploy-config", default=None, help="Deploy config YAML path.")
        group.add_argument(
            "--diffusion-attention-backend",
            choices=DIFFUSION_ATTENTION_BACKENDS,
            default=None,
            help="Attention backend of diffusion stages (default: env DIFFUSION_ATTENTION_BACKEND, then auto).",
        )
        group.add_argument(
            "--request-batch-max-wait-ms",
            type=float,
            default=0.0,
            help="Milliseconds a diffusion scheduler waits for compatible requests to co-batch.",
        )
        group.add_argument("--cache-backend", choices=CACHE_BACKENDS, default=None,
                           help="Diffusion cache acceleration backend.")
        group.add_argument("--cache-config", type=_json_object("--cache-config"), default=None,
                           help="Cache backend settings as JSON.")
        group.add_argument("--fa-deterministic", action="store_true",
                           help="Deterministic FlashAttention on the dense diffusion path (slower).")
        group.add_argument("--diffusers-load-kwargs", type=_json_object("--diffusers-load-kwargs"), default=None,
                           help="Extra kwargs for diffusers from_pretrained (adapter path), as JSON.")
        group.add_argument("--use-diffusers-adapter", action="store_true",
                           help="Force the generic diffusers adapter for diffusion models.")
        group.add_argument("--model-class-name", default=None,
                           help="Diffusion pipeline class instead of model_index.json's _class_name "
                                "(e.g. WanImageToVideoPipeline, or module:Class).")
        group.add_argument("--num-gpus", type=int, default=None, help="Devices per diffusion stage.")
        group.add_argument("--stage-init-timeout", type=float, default=None,
                           help="Seconds one stage may take to start.")
        group.add_argument("--init-timeout", type=float, default=None,
                           help="Seconds the whole pipeline may take to start.")
        group.add_argument("--max-stage-restarts", type=int, default=None,
                           help="Times a diffusion stage replaces workers that died before it is dead "
                                "(default 3).")
        # Unset unless given: diffusion stages default to eager and AR stages to compiled, so both
        # --enforce-eager and --no-enforce-eager must reach the stages.
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
