"""Tiny Qwen2 / Qwen3 causal LMs in the layout of Qwen/Qwen2.5-7B-Instruct and Qwen/Qwen3-8B.

Real repos: config.json, generation_config.json, tokenizer files, model-0000X-of-0000N.safetensors and
model.safetensors.index.json. vLLM CPU needs head_dim >= 32, so heads are 32 wide.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_omni.catalog.tiny import tiny_checkpoint
from vllm_omni.catalog.tiny_tokenizers import build_qwen_bpe, qwen_config, save_qwen_tokenizer


def _write_lm(
    out: Path,
    model_type: str,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    num_shards: int,
    seed: int,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tok = build_qwen_bpe(vocab_size)
    save_qwen_tokenizer(out, tok)
    eos = tok.token_to_id("<|im_end|>")
    extra = {"head_dim": hidden_size // num_heads} if model_type == "qwen3" else {}
    config = qwen_config(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<|endoftext|>"),
        eos_token_id=eos,
        dtype="bfloat16",
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    total = sum(p.numel() * 2 for p in model.parameters())  # bf16 bytes on disk
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size=max(total // num_shards + 1, 1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config.bos_token_id, "eos_token_id": [eos], "do_sample": False})
    )


_DEFAULTS = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    vocab_size=1024,
    num_shards=2,
    seed=0,
)


@tiny_checkpoint(
    "Qwen2 causal LM, 2 layers, hidden 64 (layout of Qwen/Qwen2.5-7B-Instruct)",
    **_DEFAULTS,
)
def build_qwen2(out: Path, **params) -> None:
    _write_lm(out, "qwen2", **params)


@tiny_checkpoint(
    "Qwen3 causal LM, 2 layers, hidden 64 (layout of Qwen/Qwen3-8B)",
    **_DEFAULTS,
)
def build_qwen3(out: Path, **params) -> None:
    _write_lm(out, "qwen3", **params)
