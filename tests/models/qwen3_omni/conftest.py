"""Shared fixtures: the tiny checkpoint and transformers' reference model (loaded once per module)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_omni.models.tiny import build_tiny


def chat_prompt_ids(path: Path, user_text: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": user_text}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, return_tensors="pt").input_ids


def hf_generate(hf_model, ids: torch.Tensor, thinker_tokens: int, talker_tokens: int):
    """transformers' greedy reference: (text tokens, codec frames, waveform) of one prompt."""
    seen = {}
    chunked_decode = hf_model.code2wav.chunked_decode

    def record_codes(codes, **kwargs):
        seen["frames"] = codes[0].T.tolist()
        return chunked_decode(codes, **kwargs)

    hf_model.code2wav.chunked_decode = record_codes
    try:
        sequences, wav = hf_model.generate(
            ids, thinker_max_new_tokens=thinker_tokens, thinker_do_sample=False, thinker_eos_token_id=None,
            talker_do_sample=False, talker_max_new_tokens=talker_tokens, talker_repetition_penalty=1.0,
            return_audio=True)
    finally:
        del hf_model.code2wav.chunked_decode
    return sequences[0, ids.shape[1]:].tolist(), seen["frames"], wav[0, 0].numpy()


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    return build_tiny("qwen3-omni")


@pytest.fixture(scope="module")
def hf_model(tiny_path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.float32).eval()
