"""Shared fixtures: the tiny checkpoint and transformers' reference model (loaded once per module)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_omni.testing.tiny_models import build_tiny


def chat_prompt_ids(path: Path, user_text: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": user_text}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, return_tensors="pt").input_ids


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    return build_tiny("qwen3-omni")


@pytest.fixture(scope="module")
def hf_model(tiny_path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.float32).eval()
