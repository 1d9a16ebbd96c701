"""vllm-omni: omni-modality inference and serving on vLLM.

Importing the package stays light; the heavy entry points load on first use.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "Omni": "vllm_omni.entrypoints.omni",
    "AsyncOmni": "vllm_omni.entrypoints.async_omni",
    "OmniDiffusionSamplingParams": "vllm_omni.inputs.data",
    "OmniRequestOutput": "vllm_omni.outputs",
}

if TYPE_CHECKING:
    from vllm_omni.entrypoints.async_omni import AsyncOmni
    from vllm_omni.entrypoints.omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.outputs import OmniRequestOutput


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vllm_omni' has no attribute {name!r}")


__all__ = ["AsyncOmni", "Omni", "OmniDiffusionSamplingParams", "OmniRequestOutput", "__version__"]
