"""Diffusion prompts are bounded by the text encoder's token limit, before anything is queued (issue 13).

What it pins: a prompt (or negative prompt) over the family's `max_prompt_tokens` is an OmniClientError naming
the field — from its length alone when it is longer than any such prompt can be (no tokenizing megabytes), by
counting tokens otherwise; a prompt at the limit passes; every native family declares its limit.
"""

from __future__ import annotations

import time

import pytest

from vllm_omni.catalog.registry import MODEL_REGISTRY
from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.diffusion.prompt_bound import PromptBound
from vllm_omni.errors import OmniClientError


@pytest.fixture(scope="module")
def bound() -> PromptBound:
    return PromptBound.for_model(build_tiny("qwen-image"), "tokenizer", max_tokens=16)


def test_over_the_limit_is_refused_naming_the_field(bound):
    with pytest.raises(OmniClientError, match="tokens; this model's text encoder reads at most 16") as exc:
        bound.check({"prompt": "a cat", "negative_prompt": " ".join(["word"] * 40)})
    assert exc.value.param == "negative_prompt" and exc.value.status_code == 400
    bound.check({"prompt": "a cat", "negative_prompt": None})


def test_a_huge_prompt_is_refused_from_its_length(bound):
    start = time.perf_counter()
    with pytest.raises(OmniClientError, match="characters") as exc:
        bound.check({"prompt": "a" * (50 * 2**20)})
    assert exc.value.param == "prompt" and time.perf_counter() - start < 0.5


def test_exactly_at_the_limit_passes(bound):
    ids = bound.tokenizer("a cat holding a sign", add_special_tokens=False).input_ids
    text = bound.tokenizer.decode((ids * 16)[:16])
    assert len(bound.tokenizer(text, add_special_tokens=False).input_ids) == 16
    bound.check({"prompt": text})


@pytest.mark.parametrize("class_name, limit", [("QwenImagePipeline", 1024), ("QwenImageEditPipeline", 1024),
                                               ("FluxPipeline", 512), ("WanPipeline", 512),
                                               ("WanImageToVideoPipeline", 512)])
def test_native_families_declare_their_limit(class_name, limit):
    assert MODEL_REGISTRY.diffusion_entry(class_name).max_prompt_tokens == limit
