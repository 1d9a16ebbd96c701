"""The `lora` request field: which adapters a diffusion request runs with, and at what scale.

A request names an adapter the server registered (`--lora-modules`, `/v1/load_lora_adapter`) or gives a local
path, as one object or a list of them (several adapters add up, each at its own scale):

    {"name": "ghibli", "scale": 0.8}
    [{"name": "ghibli"}, {"path": "/loras/pixel.safetensors", "scale": 0.5}]

LTX-2's `refine_lora` (the adapter of the two-stage variant's refine pass) is one such object.

The API process resolves names to paths before the request is queued, so a worker only sees paths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm_omni.errors import OmniClientError

MAX_LORAS_PER_REQUEST = 8
_KEYS = ("name", "path", "scale")


@dataclass(frozen=True)
class LoRARef:
    """One adapter of a request: `name` (registered, or the path when none was given), `path` (None until
    resolved), `scale` (the multiplier of its delta, diffusers' `set_adapters` weight)."""

    name: str
    path: str | None
    scale: float

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "scale": self.scale}


def parse_lora(value: Any, field: str = "lora") -> tuple[LoRARef, ...]:
    """The adapters of a `lora` value (None: none); OmniClientError naming `field` for any malformed entry."""
    if value is None:
        return ()
    entries = value if isinstance(value, list) else [value]
    if not 1 <= len(entries) <= MAX_LORAS_PER_REQUEST:
        raise OmniClientError(
            f"{field} must list 1 to {MAX_LORAS_PER_REQUEST} adapters, got {len(entries)}", param=field
        )
    refs = []
    for i, entry in enumerate(entries):
        where = f"{field}[{i}]" if isinstance(value, list) else field
        if not isinstance(entry, dict):
            raise OmniClientError(
                f'{where} must be an object {{"name" or "path", "scale"}}, got {entry!r}', param=field
            )
        unknown = sorted(set(entry) - set(_KEYS))
        if unknown:
            raise OmniClientError(f"{where} has unknown key(s) {unknown} (known: {list(_KEYS)})", param=field)
        name, path, scale = entry.get("name"), entry.get("path"), entry.get("scale", 1.0)
        if name is None and path is None:
            raise OmniClientError(f'{where} needs a "name" (a registered adapter) or a "path"', param=field)
        for key, text in (("name", name), ("path", path)):
            if text is not None and (not isinstance(text, str) or not text):
                raise OmniClientError(f"{where}.{key} must be a non-empty string, got {text!r}", param=field)
        if not isinstance(scale, int | float) or isinstance(scale, bool) or not math.isfinite(scale):
            raise OmniClientError(f"{where}.scale must be a finite number, got {scale!r}", param=field)
        refs.append(LoRARef(name or path, path, float(scale)))
    if len({ref.name for ref in refs}) != len(refs):
        raise OmniClientError(f"{field} names the same adapter twice (give it one scale)", param=field)
    return tuple(refs)


def parse_refine_lora(value: Any) -> LoRARef | None:
    """The adapter of a `refine_lora` value (None: none): one object, as one entry of `lora`."""
    if isinstance(value, list):
        raise OmniClientError('refine_lora is one adapter object {"name" or "path", "scale"}, not a list',
                              param="refine_lora")
    refs = parse_lora(value, "refine_lora")
    return refs[0] if refs else None
