"""Tiny random-weight checkpoints in the exact on-disk layout of the real Hugging Face repos.

A builder writes one checkpoint directory (config.json / model_index.json, component subfolders,
sharded safetensors with their index where the real repo has one, a tokenizer made locally with
`tokenizers`). Builders are deterministic and cached on disk by a hash of their name, parameters and
the builders' source, so tests, benchmarks and the built-in defaults share one copy.

Built-in defaults are named `tiny/<name>` (for example `tiny/qwen2`, `tiny/qwen-image`); anything else is
a Hugging Face hub id or a local path and is returned unchanged by `resolve_model`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TINY_PREFIX = "tiny/"
Builder = Callable[..., None]
"""`builder(out_dir: Path, **params)` writes a checkpoint into `out_dir`."""


@dataclass(frozen=True)
class TinySpec:
    name: str
    builder: Builder
    params: dict[str, Any]
    description: str


_REGISTRY: dict[str, TinySpec] = {}


def register_tiny(name: str, description: str, **params: Any) -> Callable[[Builder], Builder]:
    """Register `builder` under `tiny/<name>` with default `params`."""

    def decorator(builder: Builder) -> Builder:
        _REGISTRY[name] = TinySpec(name, builder, params, description)
        return builder

    return decorator


def cache_root() -> Path:
    return Path(os.environ.get("VLLM_OMNI_TINY_CACHE", Path.home() / ".cache" / "vllm_omni" / "tiny"))


def available() -> dict[str, str]:
    _load_builders()
    return {TINY_PREFIX + name: spec.description for name, spec in sorted(_REGISTRY.items())}


def build_tiny(name: str, *, root: Path | None = None, **overrides: Any) -> Path:
    """Return the directory of `tiny/<name>` (with `overrides` applied), building it once."""
    _load_builders()
    name = name.removeprefix(TINY_PREFIX)
    if name not in _REGISTRY:
        raise KeyError(f"unknown tiny model {name!r}; available: {sorted(_REGISTRY)}")
    spec = _REGISTRY[name]
    params = {**spec.params, **overrides}
    digest = hashlib.sha256(
        json.dumps([name, params, _builders_source()], sort_keys=True, default=str).encode()
    ).hexdigest()[:12]
    out = (root or cache_root()) / f"{name}-{digest}"
    if (out / ".complete").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        spec.builder(tmp, **params)
        (tmp / ".complete").write_text(json.dumps(params, sort_keys=True, default=str))
        try:
            tmp.rename(out)
        except OSError:  # another process finished first; keep its copy
            if not (out / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(model: str) -> str:
    """`tiny/<name>` -> built local path; hub ids and paths pass through."""
    if model.startswith(TINY_PREFIX) and not Path(model).exists():
        return str(build_tiny(model))
    return model


def _builders_source() -> str:
    """Source of every builder module: a change to any shared helper rebuilds the checkpoints."""
    from vllm_omni.testing import tiny

    files = sorted(Path(tiny.__file__).parent.glob("*.py"))
    return "".join(f.read_text() for f in files)


def _load_builders() -> None:
    # Builders live one family per module; importing them registers them.
    from vllm_omni.testing import tiny  # noqa: F401
