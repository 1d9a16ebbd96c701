"""The tiny LM checkpoints load in transformers and in real vLLM (CPU), and both agree on greedy tokens.

Why it matters: every AR-stage test and benchmark runs on these checkpoints; if their layout drifted from
the real Qwen repos, vLLM's loader (not ours) would be what broke.
"""

from __future__ import annotations

import json

import pytest
import torch

from vllm_omni.catalog.tiny import available, build_tiny, resolve_model

PROMPT = "A photo of a cat sitting on a red chair"


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_layout_matches_real_repo(name: str) -> None:
    path = build_tiny(name)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and all((path / s).exists() for s in shards)
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (path / f).exists(), f
    assert build_tiny(name) == path  # cached by parameter hash
    assert resolve_model(f"tiny/{name}") == str(path)
    assert f"tiny/{name}" in available()


def _hf_greedy(path, n: int) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_vllm_generates_same_greedy_tokens_as_transformers() -> None:
    from vllm import LLM, SamplingParams

    path = str(build_tiny("qwen2"))
    llm = LLM(model=path, dtype="float32", gpu_memory_utilization=0.15, max_model_len=256,
              enforce_eager=True, seed=0)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, ignore_eos=True)
        out = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    finally:
        del llm
    assert list(out) == _hf_greedy(path, 8)
