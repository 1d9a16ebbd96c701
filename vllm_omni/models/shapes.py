"""Which output shapes a diffusion pipeline can make, known from the checkpoint's config files alone.

A family's `DiffusionPipelineEntry.shape_rule` names a function that reads the checkpoint's JSON configs (no
torch, no weights) and returns a `ShapeRule`. The API process asks it through `ModelCapabilities`, so a size
the pipeline would refuse is a 400 on every route before anything is queued (a `/v1/videos` job used to be
`queued`, then `failed`), and the pipeline's own check in the worker stays as the last line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni.errors import OmniClientError


@dataclass(frozen=True)
class ShapeRule:
    size_multiple: int = 1
    """Height and width must be multiples of this (VAE downsampling x transformer patch); others are refused."""
    min_size: int = 1
    """Smallest height / width that leaves at least one latent patch."""
    frame_stride: int | None = None
    """Video pipelines: the VAE packs 1 + k * frame_stride frames (another count is rounded, as in diffusers);
    None for image pipelines."""

    def check(self, sp: Any, prefix: str = "", size_field: str | None = None) -> None:
        """Refuse a height / width the pipeline cannot make. `size_field` names the request field the two came
        from ("size") when the client gave them that way."""
        for name in ("width", "height"):
            value = getattr(sp, name)
            if value is None:
                continue
            param = prefix + (size_field or name)
            if value < self.min_size:
                raise OmniClientError(f"{name}={value} is smaller than this model makes ({self.min_size})",
                                      param=param)
            if value % self.size_multiple:
                raise OmniClientError(f"{name} must be a multiple of {self.size_multiple} for this model, got "
                                      f"{value}", param=param)


def read_config(model_dir: Path, subfolder: str) -> dict[str, Any]:
    return json.loads((Path(model_dir) / subfolder / "config.json").read_text())
