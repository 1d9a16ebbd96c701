"""Online FP8 (`--quantization fp8`): a DiT's linear layers quantized after loading, GEMMs in FP8.

Each quantized layer keeps its weight as float8_e4m3fn with one fp32 scale per output channel (amax / 448), and
every call quantizes its input with one scale per token (dynamic), so the GEMM is `torch._scaled_mm` with
row-wise scales on both sides, accumulated and returned in the activation dtype. The layer's vLLM quant method is
replaced (vLLM's `LinearMethodBase.apply` hook), so callers are unchanged. Layers whose error costs most and whose
GEMMs are small are kept in the stage dtype (`DEFAULT_FP8_IGNORED_LAYERS`): input embeddings, adaLN modulation and
norms, timestep embedders, the final projection; `--quantization-config '{"ignore": [...]}'` (vLLM's key) replaces that
list (fnmatch patterns over module names, e.g. "transformer_blocks.0.*").

FP8 needs a GPU with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell) or the CPU (torch's
CPU `_scaled_mm`, for tests); anything else is refused at load.
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
from torch import nn
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod

from vllm_omni.errors import OmniClientError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
DEFAULT_FP8_IGNORED_LAYERS = (
    "*embed*",
    "img_in",
    "txt_in",
    "proj_in",
    "audio_proj_in",
    "x_embedder",
    "context_embedder",
    "*_mod.*",
    "*norm*",
    "*time*",
    "proj_out",
    "audio_proj_out",
)
"""Module-name patterns kept in the stage dtype by default (see the module docstring)."""
_ALIGN = 16
"""`_scaled_mm` needs both GEMM dimensions of the weight to be multiples of 16; other layers stay unquantized."""


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (rows, cols) as FP8 with one fp32 scale per row: x ~= q * scale, |q| <= 448."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x @ W.T + bias` with `W ~= weight * weight_scale` (weight (out, in) FP8, weight_scale (out, 1)); the input is
    quantized per token here."""
    shape = x.shape
    if x.numel() == 0:  # e.g. a step input without text rows
        return x.new_empty(*shape[:-1], weight.shape[0])
    q, scale = quantize_rowwise(x.reshape(-1, shape[-1]))
    out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.t(), out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight.shape[0])


class Fp8OnlineLinearMethod(LinearMethodBase):
    """The quant method of a layer whose loaded weight `quantize_linear` converted to FP8."""

    def create_weights(self, *args, **kwargs) -> None:
        raise NotImplementedError("online FP8 converts loaded weights (quantize_linear); it creates none")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias)


def quantize_linear(layer: LinearBase) -> None:
    """Convert `layer`'s weight to FP8 in place (with its per-channel scale) and route it through FP8 GEMMs."""
    weight, scale = quantize_rowwise(layer.weight.data)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)
    layer.quant_method = Fp8OnlineLinearMethod()


def check_fp8_supported(device: torch.device) -> None:
    """Refuse a device without FP8 GEMMs (OmniClientError naming `quantization`)."""
    if device.type == "cpu":
        return
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    raise OmniClientError(
        f"quantization='fp8' (--quantization fp8) needs FP8 tensor cores (compute capability >= 8.9: "
        f"Ada, Hopper, Blackwell); {name} has none: serve in bf16",
        param="quantization",
    )


def apply_online_fp8(
    model: nn.Module, device: torch.device, ignored_layers: tuple[str, ...] | list[str] | None = None
) -> list[str]:
    """Quantize every unquantized vLLM linear of `model` whose name matches no pattern of `ignored_layers`
    (default `DEFAULT_FP8_IGNORED_LAYERS`) and whose shape `_scaled_mm` takes; returns their names."""
    check_fp8_supported(device)
    patterns = DEFAULT_FP8_IGNORED_LAYERS if ignored_layers is None else tuple(ignored_layers)
    quantized = []
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or not isinstance(module.quant_method, UnquantizedLinearMethod):
            continue
        if any(fnmatch(name, pattern) for pattern in patterns):
            continue
        if module.weight.numel() == 0 or any(size % _ALIGN for size in module.weight.shape):
            continue
        quantize_linear(module)
        quantized.append(name)
    return quantized
