"""Lets vLLM's Qwen-VL family (Qwen3-Omni's thinker included) import on a host without torchvision.

vLLM 0.32's `qwen2_vl.py` / `qwen3_vl.py` import `smart_resize` from
`transformers.models.qwen2_vl.image_processing_qwen2_vl`, which since transformers 5 is the torchvision
backend and imports torchvision at module level. CPU hosts here must not install torchvision (only CUDA builds
resolve), so the import fails before any Qwen-VL/Omni model can even be inspected. transformers ships the same
functions in its PIL backend module; when torchvision is absent we register that module under the torchvision
module's name. Explicit (called from our vLLM plugin hook), idempotent, and a no-op whenever torchvision exists
or a future transformers stops needing it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

_TV_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def alias_qwen2_vl_image_processing() -> bool:
    """Returns True when the alias is (or already was) installed."""
    if sys.modules.get(_TV_MODULE) is not None:
        return sys.modules[_TV_MODULE].__name__ == _PIL_MODULE
    if importlib.util.find_spec("torchvision") is not None:
        return False
    try:
        importlib.import_module(_TV_MODULE)
        return False  # this transformers version imports fine without torchvision
    except ModuleNotFoundError as e:
        if e.name != "torchvision":
            raise
    sys.modules[_TV_MODULE] = importlib.import_module(_PIL_MODULE)
    return True
