"""Weight loaders for parameters without their own `weight_loader`.

Same contract as vLLM's `default_weight_loader`, kept here because importing `vllm.model_executor.model_loader`
pulls in vLLM's attention backends, which need vLLM's compiled CUDA extensions (absent where only vLLM's Python
tree is installed, e.g. our GPU benchmark images).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy `loaded_weight` into `param` (shapes must match; a 1-element tensor may fill a scalar)."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        param.data.fill_(loaded_weight.item())
        return
    if param.shape != loaded_weight.shape:
        raise ValueError(f"weight shape {tuple(loaded_weight.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def process_weights_after_loading(model: torch.nn.Module) -> None:
    """Let vLLM's linear methods repack the filled weights for the platform's GEMM (e.g. oneDNN on CPU; once)."""
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(module)


def load_mapped_weights(
    model: torch.nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    map_name: Callable[[str], tuple[str, str | int | None]],
) -> set[str]:
    """Load diffusers-named tensors into `model`: `map_name` gives each checkpoint name our parameter's name and
    the shard of a stacked parameter (or None). Returns the names of the parameters that were filled."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        target, shard = map_name(name)
        if target not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no matching parameter ({target!r})")
        param = params[target]
        loader = getattr(param, "weight_loader", default_weight_loader)
        if shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
        loaded.add(target)
    return loaded
