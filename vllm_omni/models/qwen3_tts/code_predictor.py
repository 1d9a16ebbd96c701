"""Qwen3-TTS code predictor: a small dense Qwen3 decoder (transformers' `Qwen3Model`) that, per audio frame,
fills codebooks 1..G-1 from the talker's last hidden state and codebook 0's embedding.

It has the interface `qwen3_omni.talker.predict_residual_codes` drives (`model(inputs_embeds=...)`,
`model.codec_embedding[g]`, `lm_head[g]`, `config.num_code_groups`), so the Qwen3-Omni MTP step serves it
unchanged. Its inputs live in the talker's width: `small_to_mtp_projection` maps them to the predictor's own
(identity when the widths agree) before the decoder, while the frame's summed codec embedding stays in the
talker's width.
"""

from __future__ import annotations

import torch
from torch import nn


class _PredictorDecoder(nn.Module):
    def __init__(self, config, talker_hidden_size: int) -> None:
        super().__init__()
        from transformers import Qwen3Model

        self.decoder = Qwen3Model(config)
        self.decoder.embed_tokens = None  # inputs are always embeddings; the checkpoint has no such table
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(config.vocab_size, talker_hidden_size) for _ in range(config.num_code_groups - 1))
        self.small_to_mtp_projection: nn.Module = (
            nn.Linear(talker_hidden_size, config.hidden_size, bias=True)
            if config.hidden_size != talker_hidden_size else nn.Identity())

    def forward(self, inputs_embeds: torch.Tensor, past_key_values=None, use_cache: bool = True):
        return self.decoder(inputs_embeds=self.small_to_mtp_projection(inputs_embeds),
                            past_key_values=past_key_values, use_cache=use_cache)


class Qwen3TTSCodePredictor(nn.Module):
    def __init__(self, config, talker_hidden_size: int) -> None:
        """`config` is the talker config's `code_predictor_config`."""
        super().__init__()
        self.config = config
        self.model = _PredictorDecoder(config, talker_hidden_size)
        self.lm_head = nn.ModuleList(
            nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_code_groups - 1))

    def load_weights(self, weights) -> set[str]:
        """Checkpoint names below `talker.code_predictor.`: `model.{layers,norm}` are the decoder's,
        `small_to_mtp_projection` sits beside `model` there."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name.startswith("small_to_mtp_projection."):
                target = "model." + name
            elif name.startswith(("model.layers.", "model.norm.")):
                target = "model.decoder." + name.removeprefix("model.")
            else:
                target = name
            if target not in params:
                raise KeyError(f"unexpected code predictor weight {name!r}")
            params[target].data.copy_(tensor)
            loaded.add(target)
        return loaded
