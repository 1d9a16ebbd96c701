"""Tiny random-weight checkpoints in the exact on-disk layout of the real Hugging Face repos.

A builder writes one checkpoint directory (config.json / model_index.json, component subfolders,
sharded safetensors with their index where the real repo has one, a tokenizer made locally with
`tokenizers`). Builders are deterministic and cached on disk by a hash of their name, parameters and
the builders' source, so tests, benchmarks and the built-in defaults share one copy.

Built-in defaults are named `tiny/<name>` (for example `tiny/qwen2`, `tiny/qwen-image`); each family lists its
builders in its spec (`ModelSpec.tiny`), next to the model code in `vllm_omni/models/<family>/tiny.py`. Anything
else is a Hugging Face hub id or a local path and is returned unchanged by `resolve_model`. They are a product
feature (the built-in defaults the README serves), not a test helper.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni import envs

TINY_PREFIX = "tiny/"
Builder = Callable[..., None]
"""`builder(out_dir: Path, **params)` writes a checkpoint into `out_dir`."""


@dataclass(frozen=True)
class TinySpec:
    description: str
    params: dict[str, Any]


def tiny_checkpoint(description: str, **params: Any) -> Callable[[Builder], Builder]:
    """Mark `builder` as a tiny checkpoint builder with default `params` (its family's spec names it)."""

    def decorator(builder: Builder) -> Builder:
        builder.tiny_spec = TinySpec(description, params)  # type: ignore[attr-defined]
        return builder

    return decorator


def cache_root() -> Path:
    return envs.VLLM_OMNI_TINY_CACHE


def available() -> dict[str, str]:
    from vllm_omni.catalog.registry import MODEL_REGISTRY

    return {TINY_PREFIX + name: MODEL_REGISTRY.tiny_builder(name).tiny_spec.description
            for name in MODEL_REGISTRY.tiny_names()}


def build_tiny(name: str, *, root: Path | None = None, **overrides: Any) -> Path:
    """Return the directory of `tiny/<name>` (with `overrides` applied), building it once."""
    name, builder, params, out = _tiny_dir(name, root, overrides)
    if (out / ".complete").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        builder(tmp, **params)
        (tmp / ".complete").write_text(json.dumps(params, sort_keys=True, default=str))
        try:
            tmp.rename(out)
        except OSError:  # another process finished first; keep its copy
            if not (out / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def built_tiny(name: str) -> Path | None:
    """The directory of `tiny/<name>` if it is built, else None (nothing is built)."""
    out = _tiny_dir(name, None, {})[3]
    return out if (out / ".complete").exists() else None


def _tiny_dir(name: str, root: Path | None, overrides: dict[str, Any]) -> tuple[str, Builder, dict[str, Any], Path]:
    """The name without its prefix, its builder, the builder's params and the directory they build."""
    from vllm_omni.catalog.registry import MODEL_REGISTRY

    name = name.removeprefix(TINY_PREFIX)
    builder = MODEL_REGISTRY.tiny_builder(name)
    params = {**builder.tiny_spec.params, **overrides}
    digest = hashlib.sha256(
        json.dumps([name, params, _builder_source(builder)], sort_keys=True, default=str).encode()
    ).hexdigest()[:12]
    return name, builder, params, (root or cache_root()) / f"{name}-{digest}"


def resolve_model(model: str) -> str:
    """`tiny/<name>` -> built local path; hub ids and paths pass through."""
    if model.startswith(TINY_PREFIX) and not Path(model).exists():
        return str(build_tiny(model))
    return model


def _builder_source(builder: Builder) -> str:
    """Source of the builder's module and the shared tokenizer helpers: a change to either rebuilds."""
    import inspect

    from vllm_omni.catalog import tiny_tokenizers

    return inspect.getsource(inspect.getmodule(builder)) + inspect.getsource(tiny_tokenizers)
