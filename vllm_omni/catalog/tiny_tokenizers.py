"""Tokenizers trained locally on a fixed corpus, so tiny checkpoints never need a download, and the tiny Qwen
models that go with the Qwen tokenizer (the LLM family and the diffusion pipelines that prompt a Qwen3)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "A photo of a cat sitting on a red chair in the morning light.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Describe the image in detail, then answer the question about colors and shapes.",
    "vllm-omni serves text, audio, images and video from one engine.",
    "Hello! How are you today? I am fine, thank you. What can I do for you?",
    "Once upon a time there was a small robot that loved to paint mountains and oceans.",
    "1 2 3 4 5 6 7 8 9 10 100 1000 one two three four five six seven eight nine ten",
    "system user assistant tool image video audio text speech music sound voice",
]

QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)
"""Qwen3's template in the part the diffusion text encoders use: user turns, the generation prompt and, with
`enable_thinking=False`, the empty think block the real template writes (Z-Image thinks, FLUX.2 klein does not)."""


def build_qwen_bpe(
    vocab_size: int = 1024,
    *,
    corpus: list[str] = CORPUS,
    special_tokens: list[str] = QWEN_SPECIAL_TOKENS,
) -> Tokenizer:
    """A byte-level BPE like Qwen2's (same pre-tokenizer family and special tokens), trained on `corpus`."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    tok.add_special_tokens(special_tokens)
    return tok


def save_qwen_tokenizer(
    out_dir: Path,
    tok: Tokenizer,
    *,
    chat_template: str | None = CHATML_TEMPLATE,
    special_tokens: list[str] = QWEN_SPECIAL_TOKENS,
    extra_config: dict | None = None,
) -> None:
    """Write tokenizer.json + tokenizer_config.json (+ vocab.json/merges.txt) as Qwen repos ship them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    model = json.loads(tok.to_str())["model"]
    (out_dir / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in special_tokens
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": special_tokens[1:],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    config.update(extra_config or {})
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def qwen_config(
    model_type: str,
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    **extra,
):
    """A transformers config of a tiny Qwen2 / Qwen3 with the real repos' RoPE base; `extra` for the rest."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        rope_theta=1000000.0,
        **extra,
    )


def write_qwen3_text_encoder(
    out_dir: Path,
    model_cls: type,
    *,
    seed: int,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    max_shard_size: str,
) -> None:
    """tokenizer/ (Qwen3's chat template) and text_encoder/ (sharded) of a diffusion repo whose prompt encoder is
    a Qwen3 (`Qwen3Model` for Z-Image, `Qwen3ForCausalLM` for FLUX.2 klein): heads 32 wide, one KV head, tied
    embeddings, seeded with `seed`."""
    import torch

    save_qwen_tokenizer(out_dir / "tokenizer", build_qwen_bpe(vocab_size), chat_template=QWEN3_CHAT_TEMPLATE)
    torch.manual_seed(seed)
    config = qwen_config(
        "qwen3",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
    )
    text_encoder = model_cls(config).eval()
    text_encoder.save_pretrained(out_dir / "text_encoder", safe_serialization=True, max_shard_size=max_shard_size)
