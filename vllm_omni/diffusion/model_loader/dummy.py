"""Component loading by `load_format`: the checkpoint's weights (auto) or random weights from configs (dummy).

`dummy` reads only config files and tokenizers and builds every component from its config on the target device
and dtype, like vLLM's `--load-format dummy`: weights drawn from uniform(-1e-3, 1e-3) with a fixed seed, so
activations stay finite and runs repeat. Real model sizes can then be served and benchmarked on a machine that
has no checkpoint. vLLM's own `initialize_dummy_weights` is not imported because `vllm.model_executor.model_loader`
needs vLLM's compiled extensions (see weight_utils.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from vllm_omni.catalog.resolution import WEIGHT_FILE_PATTERNS
from vllm_omni.diffusion.model_loader.diffusers_loader import iter_component_weights
from vllm_omni.diffusion.model_loader.weight_utils import process_weights_after_loading

DUMMY_LOW, DUMMY_HIGH, DUMMY_SEED = -1e-3, 1e-3, 1234
ModuleT = TypeVar("ModuleT", bound=nn.Module)


def initialize_dummy_weights(module: nn.Module, seed: int = DUMMY_SEED) -> None:
    """Fill every floating-point parameter with uniform(-1e-3, 1e-3) from one seeded generator per device.

    Buffers are left as the constructor computed them from the config (RoPE tables, position ids): a checkpoint
    does not carry them either.
    """
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for param in module.parameters():
            if not param.is_floating_point():
                continue
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=generators[param.device])


def build_from_config(cls: type[ModuleT], folder: Path, device: torch.device, dtype: torch.dtype) -> ModuleT:
    """A transformers or diffusers model class built from `folder`'s config on `device`, with dummy weights."""
    from transformers import PreTrainedModel
    from vllm.utils.torch_utils import set_default_torch_dtype

    if issubclass(cls, PreTrainedModel):
        config = cls.config_class.from_pretrained(folder)
        with torch.device(device):
            model = cls._from_config(config, dtype=dtype)
    else:  # a diffusers ModelMixin
        with set_default_torch_dtype(dtype), torch.device(device):
            model = cls.from_config(cls.load_config(folder))
    initialize_dummy_weights(model)
    return model.eval()


def load_pretrained(cls: type[ModuleT], folder: Path, *, device: torch.device, dtype: torch.dtype,
                    load_format: str) -> ModuleT:
    """`cls.from_pretrained(folder)` on `device` in eval mode, or (dummy) built from `folder`'s config alone."""
    if load_format == "dummy":
        return build_from_config(cls, folder, device, dtype)
    return cls.from_pretrained(folder, dtype=dtype).to(device).eval()


def build_diffusers_pipeline(model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """The `DiffusionPipeline` of `model_index.json` with every model component built by `build_from_config`;
    schedulers, tokenizers and processors are read as usual (they are configs)."""
    import importlib
    import inspect
    import json

    import diffusers

    index = json.loads((Path(model_dir) / "model_index.json").read_text())
    pipe_cls = getattr(diffusers, index["_class_name"])
    accepted = inspect.signature(pipe_cls.__init__).parameters
    kwargs: dict[str, Any] = {}
    for name, spec in index.items():
        if name not in accepted:
            continue
        if not isinstance(spec, list):  # a pipeline setting such as boundary_ratio
            kwargs[name] = spec
        elif spec[0] is None:
            kwargs[name] = None
        else:
            cls = getattr(importlib.import_module(spec[0]), spec[1])
            folder = Path(model_dir) / name
            is_model = issubclass(cls, nn.Module)
            kwargs[name] = build_from_config(cls, folder, device, dtype) if is_model else cls.from_pretrained(folder)
    return pipe_cls(**kwargs)


def load_native_weights(model: nn.Module, model_dir: Path, subfolder: str, load_format: str,
                        dtype: torch.dtype | None = None) -> None:
    """Fill one of our transformers: the checkpoint's tensors by name (every parameter must get one) or dummy;
    then let vLLM's linear methods prepare the filled weights."""
    if load_format == "dummy":
        initialize_dummy_weights(model)
    else:
        loaded = model.load_weights(iter_component_weights(model_dir, subfolder, dtype))
        missing = sorted({name for name, _ in model.named_parameters()} - loaded)
        if missing:
            raise ValueError(f"{Path(model_dir) / subfolder}: checkpoint lacks weights for {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")
    process_weights_after_loading(model)


def check_weights_present(model_dir: Path) -> None:
    """Fail before loading anything when model components (folders with a config.json) have no weight files.

    Names every such folder and the way to run without weights, instead of the first library's own error.
    """
    import json

    index_path = Path(model_dir) / "model_index.json"
    if not index_path.is_file():  # a custom pipeline class with its own layout checks its own files
        return
    index = json.loads(index_path.read_text())
    components = [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0]]
    empty = [sub for sub in components if (Path(model_dir) / sub / "config.json").is_file()
             and not any(next((Path(model_dir) / sub).glob(p), None) for p in WEIGHT_FILE_PATTERNS)]
    if empty:
        raise FileNotFoundError(
            f"{model_dir}: no weight files ({', '.join(WEIGHT_FILE_PATTERNS[:2])}, ...) in component folder(s) "
            f"{empty}; pass load_format='dummy' (--load-format dummy) to run with random weights from the configs")
