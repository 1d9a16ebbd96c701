"""The tiny Qwen3-Omni checkpoint has the real repo's layout and transformers' reference generate runs on it.

Why it matters: every Qwen3-Omni alignment test compares against transformers on these weights; a layout drift
(per-expert weight names, config fields vLLM reads, tokenizer special tokens) would break vLLM's loader first.
"""

from __future__ import annotations

import json

import torch

from vllm_omni.catalog.tiny import build_tiny

from .conftest import chat_prompt_ids


def test_layout_matches_real_repo() -> None:
    path = build_tiny("qwen3-omni")
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
              "merges.txt", "chat_template.json", "preprocessor_config.json", "model.safetensors.index.json"):
        assert (path / f).exists(), f
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and all((path / s).exists() for s in shards)
    names = set(index["weight_map"])
    # Per-expert MoE weights (what the real repo and vLLM's loader use), the talker's shared expert,
    # one code-predictor head per residual codebook, and the vocoder.
    assert "thinker.model.layers.0.mlp.experts.3.gate_proj.weight" in names
    assert "talker.model.layers.0.mlp.shared_expert_gate.weight" in names
    assert "talker.code_predictor.lm_head.2.weight" in names
    assert "code2wav.code_embedding.weight" in names
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert {"thinker_config", "talker_config", "code2wav_config"} <= set(config)


def test_every_weight_is_drawn() -> None:
    """Why: transformers' init leaves some tensors (the talker's MoE experts) as allocated memory; a checkpoint
    built after other work in the same process then held NaN / 1e36 experts and vLLM's talker sampled from NaN.
    Every tensor must be finite and of init scale, the experts drawn at the talker's initializer_range."""
    from safetensors.torch import load_file

    path = build_tiny("qwen3-omni")
    for shard in sorted(path.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            t = tensor.float()
            assert torch.isfinite(t).all() and t.abs().max() < 100, name
            if ".mlp.experts." in name:
                assert 0.01 < t.std() < 0.04, (name, t.std())


def test_transformers_generate_text_and_audio(hf_model, tiny_path) -> None:
    ids = chat_prompt_ids(tiny_path, "Hello! How are you today?")
    sequences, wav = hf_model.generate(
        ids, thinker_max_new_tokens=6, thinker_do_sample=False, talker_do_sample=False,
        talker_max_new_tokens=6, talker_repetition_penalty=1.0, return_audio=True,
    )
    assert sequences.shape[1] == ids.shape[1] + 6
    samples_per_code = int(hf_model.code2wav.total_upsample)
    assert wav.shape[:2] == (1, 1) and wav.shape[-1] >= samples_per_code
    assert torch.isfinite(wav).all() and wav.abs().max() <= 1.0
    assert wav.std() > 1e-3  # audible: a silent vocoder would make waveform comparisons vacuous
