"""The one way a native pipeline builds its own diffusion transformer from a checkpoint component.

Qwen-Image, FLUX and Wan used to build their DiTs three ways, and the Wan way dropped the attention backend.
`load_native_transformer` always applies every stage setting, in this order: dtype and device, the attention
config (`--diffusion-attention-backend`, `--fa-deterministic`) as a constructor argument that the model hands to
each of its attention layers, the weights (or dummy ones), fp32 islands, online FP8, layerwise offload, the
class's sequence-parallel plan (`distributed/sequence_plan.py`; a class without one is refused before it is
built), and acceleration.

The model class provides `from_config(config: dict, *, prefix, attn_config)` (diffusers' constructor name),
`load_weights` (vLLM's), and optionally `_keep_in_fp32_modules` (diffusers' convention).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn
from vllm.model_executor.layers.linear import LinearBase

from vllm_omni.diffusion.attention.selector import DiffusionAttentionConfig
from vllm_omni.diffusion.distributed.parallel_state import sequence_parallel_size
from vllm_omni.diffusion.distributed.sequence_plan import apply_sequence_plan, check_sequence_plan
from vllm_omni.diffusion.layers.compile import accelerate_if_requested
from vllm_omni.diffusion.layers.fp8 import apply_online_fp8
from vllm_omni.diffusion.model_loader.diffusers_loader import read_component_config
from vllm_omni.diffusion.model_loader.dummy import load_native_weights
from vllm_omni.diffusion.offload.distributed import apply_distributed_layerwise_offload
from vllm_omni.diffusion.offload.layerwise import apply_layerwise_offload

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig

ModelT = TypeVar("ModelT", bound=nn.Module)


def load_native_transformer(cls: type[ModelT], model_dir: Path, subfolder: str, od_config: OmniDiffusionConfig,
                            device: torch.device, dtype: torch.dtype, *, cuda_graphs: bool = True) -> ModelT:
    """`model_dir/subfolder` as our `cls`, ready to serve; `cuda_graphs=False` keeps acceleration to compiled
    blocks (for models whose forward is GPU-bound anyway)."""
    from vllm.utils.torch_utils import set_default_torch_dtype

    check_sequence_plan(cls)
    attn_config = DiffusionAttentionConfig.from_od_config(od_config)
    config = read_component_config(model_dir, subfolder)
    # Offloaded, the model is built in host memory: it need never fit the device whole.
    offload = od_config.enable_layerwise_offload or od_config.enable_distributed_layerwise_offload
    build_device = torch.device("cpu") if offload else device
    with set_default_torch_dtype(dtype), build_device:
        model = cls.from_config(config, prefix=f"{subfolder}.", attn_config=attn_config)
    if offload or od_config.quantization is not None:
        keep_linear_weights(model)
    load_native_weights(model, model_dir, subfolder, od_config.load_format, dtype)
    keep_in_fp32_modules(model)
    if od_config.quantization == "fp8":  # before offload: the blocks are packed as they will run
        apply_online_fp8(model, device, od_config.quantization_config.get("ignore"))
    if od_config.enable_layerwise_offload:
        apply_layerwise_offload(model, device, od_config.offload_resident_layers, od_config.offload_prefetch_layers)
    elif od_config.enable_distributed_layerwise_offload:  # over the world: DLO runs without other parallelism
        apply_distributed_layerwise_offload(model, device, None, od_config.dlo_resident_layers,
                                            od_config.dlo_use_allgather)
    if sequence_parallel_size() > 1:
        apply_sequence_plan(model)
    accelerate_if_requested(model, od_config, device, cuda_graphs=cuda_graphs)
    return model.eval()


def keep_linear_weights(model: nn.Module) -> None:
    """Keep every vLLM linear's weight a parameter after loading: on CPU vLLM repacks it into a oneDNN handle and
    drops the parameter, which offload (it moves parameters) and FP8 (it quantizes them) need. vLLM's
    `_cpu_skip_gemm_dispatch` makes such a layer run `F.linear` on its parameter; other platforms ignore it."""
    for module in model.modules():
        if isinstance(module, LinearBase):
            module._cpu_skip_gemm_dispatch = True


def keep_in_fp32_modules(model: nn.Module) -> None:
    """Cast the modules and parameters named in `model._keep_in_fp32_modules` (last name part) back to fp32."""
    names = set(getattr(model, "_keep_in_fp32_modules", ()))
    if not names:
        return
    for name, module in model.named_modules():
        if name.split(".")[-1] in names:
            module.float()
    for name, param in model.named_parameters():
        if name.split(".")[-1] in names:
            param.data = param.data.float()
