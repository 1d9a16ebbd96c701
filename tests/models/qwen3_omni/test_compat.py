"""The torchvision-free import shim for vLLM's Qwen-VL family (see qwen3_omni/compat.py for why)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from vllm_omni.models.qwen3_omni.compat import alias_qwen2_vl_image_processing


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision present: no shim")
def test_alias_lets_vllm_thinker_module_import() -> None:
    assert alias_qwen2_vl_image_processing()
    assert alias_qwen2_vl_image_processing()  # idempotent
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    assert smart_resize(64, 64, factor=32) == (64, 64)
    importlib.import_module("vllm.model_executor.models.qwen3_omni_moe_thinker")
    assert "vllm.model_executor.models.qwen3_omni_moe_thinker" in sys.modules
