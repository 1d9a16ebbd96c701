"""Model-level CPU offload (`--enable-cpu-offload`): the text encoder(s) and the VAE live in host memory and only
the one in use is on the device, as diffusers' `enable_model_cpu_offload`.

A component moves to the device when its forward, or the forward of one of its direct children, is called
(Wan's streamed decode calls the VAE's `post_quant_conv` and `decoder` directly, which a hook on the VAE's
forward alone, as accelerate's `cpu_offload_with_hook`, would miss), and every other offloaded component moves
back first; the pipeline skeleton sends them all back before each transformer forward (`offload_all`), so the
denoise loop has the device to itself (a hook on the transformer would not fire where its forward replays as a
CUDA graph, `layers/compile.CompiledForward`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

CPU_OFFLOAD_COMPONENTS = ("text_encoder", "text_encoder_2", "image_encoder", "vae")
"""Pipeline attributes moved by `--enable-cpu-offload` (diffusers' names)."""


class ComponentOffloader:
    """Keeps at most one of `components` on `device`; see the module docstring."""

    def __init__(self, components: dict[str, nn.Module], device: torch.device) -> None:
        self.components = components
        self.device = device
        self.active: str | None = None
        self._handles = []
        for name, component in components.items():
            component.to("cpu")
            for module in (component, *component.children()):
                self._handles.append(module.register_forward_pre_hook(self._onload_hook(name)))

    def _onload_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self.active != name:
                self.offload_all()
                self.components[name].to(self.device)
                self.active = name

        return hook

    def offload_all(self) -> None:
        if self.active is not None:
            self.components[self.active].to("cpu")
            self.active = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def apply_cpu_offload(pipeline: Any, device: torch.device) -> ComponentOffloader:
    """Install a `ComponentOffloader` over the pipeline's text encoders and VAE (the attributes of
    `CPU_OFFLOAD_COMPONENTS` that are modules) as its `cpu_offloader`; ValueError when it has none."""
    components = {
        name: module
        for name in CPU_OFFLOAD_COMPONENTS
        if isinstance(module := getattr(pipeline, name, None), nn.Module)
    }
    if not components:
        raise ValueError(
            f"enable_cpu_offload: {type(pipeline).__name__} has none of the components {list(CPU_OFFLOAD_COMPONENTS)}"
        )
    offloader = ComponentOffloader(components, device)
    pipeline.cpu_offloader = offloader
    return offloader
