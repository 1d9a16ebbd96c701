"""Qwen3-TTS talker as a vLLM model: vLLM's dense Qwen3 decoder (paged KV cache) for codebook 0, and the code
predictor (code_predictor.py) run inside the forward for each decode token.

The per-request machinery is Qwen3-Omni's (`CodecTalkerBase`: the request-identity connector, the conditioning
in `SamplingParams.extra_args`, the frames returned in-band with each step's outputs); only the text embedding
differs: the talker's own `text_embedding` table, then `text_projection`. The checkpoint's RoPE is M-RoPE, but a
TTS prompt is text only (equal temporal / height / width positions), where M-RoPE is plain RoPE, so vLLM's decoder
gets the plain rotation (`talker_hf_overrides`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from vllm_omni.models.qwen3_omni.vllm_talker import CodecTalkerBase
from vllm_omni.models.qwen3_tts.code_predictor import Qwen3TTSCodePredictor

ARCHITECTURE = "Qwen3TTSTalkerForConditionalGeneration"


def talker_hf_overrides(config):
    """vLLM `hf_overrides` for the talker stage: the checkpoint's talker config, with plain RoPE."""
    if getattr(config, "talker_config", None) is None:  # vLLM also probes the hook with a placeholder config
        return config
    talker = copy.deepcopy(config.talker_config)
    talker.architectures = [ARCHITECTURE]
    talker.rope_parameters = {k: v for k, v in (talker.rope_parameters or {}).items()
                              if k not in ("mrope_section", "interleaved", "mrope_interleaved")}
    return talker


class Qwen3TTSTalkerForConditionalGeneration(CodecTalkerBase):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        from transformers.activations import ACT2FN
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        from vllm.model_executor.models.qwen3 import Qwen3Model

        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = Qwen3Model(vllm_config=vllm_config, prefix="model")
        self.codec_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="codec_head")
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.text_embedding = nn.Embedding(config.text_vocab_size, config.text_hidden_size)
        self.text_projection = _ResizeMLP(config.text_hidden_size, config.hidden_size, ACT2FN[config.hidden_act])
        self.code_predictor = Qwen3TTSCodePredictor(config.code_predictor_config, config.hidden_size)
        self.codec_eos = config.codec_eos_token_id

    def _project(self, text_ids: torch.Tensor) -> torch.Tensor:
        return self.text_projection(self.text_embedding(text_ids))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

        mapper = WeightsMapper(orig_to_new_prefix={
            "talker.model.codec_embedding.": "model.embed_tokens.",
            "talker.model.text_embedding.": "text_embedding.",
            "talker.model.": "model.",
            "talker.codec_head.": "codec_head.",
            "talker.text_projection.": "text_projection.",
            "talker.code_predictor.": "code_predictor.",
        })
        loader = AutoWeightsLoader(self)
        return loader.load_weights(((n, w) for n, w in weights if n.startswith("talker.")), mapper=mapper)


class _ResizeMLP(nn.Module):
    """`text_projection`: text width -> text width -> talker width, with biases (the checkpoint's layout)."""

    def __init__(self, width: int, out: int, act) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(width, width, bias=True)
        self.linear_fc2 = nn.Linear(width, out, bias=True)
        self.act_fn = act

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(hidden)))
