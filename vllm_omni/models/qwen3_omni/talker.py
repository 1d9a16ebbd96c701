"""Qwen3-Omni talker stage: codec-token AR decoder (MoE) + MTP code predictor, conditioned on the thinker.

Each step the talker backbone predicts codebook 0 of one audio frame; the code predictor (a small dense
transformer) then fills codebooks 1..G-1 from the backbone's last hidden state, and the sum of the frame's G
codec embeddings plus the next trailing thinker token's projected embedding is the next backbone input.

This is the in-process variant: transformers' Qwen3-Omni layers (built from the checkpoint's `talker_config`,
loaded from its `talker.*` tensors) driven by our loop, one request at a time. It streams frames as they complete
(`iter_frames`) and samples the code predictor too. The serving variant runs on vLLM's EngineCore
(vllm_talker.py: batching, paged KV cache) and shares `predict_residual_codes` with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from vllm_omni.models.qwen3_omni.stage_input_processors import NO_CODEC, TalkerPrompt
from vllm_omni.models.qwen3_omni.weights import fuse_experts, iter_prefixed_weights, load_into


@dataclass
class TalkerSamplingParams:
    """Decoding of codebook 0 (the code predictor follows: greedy when the talker is greedy)."""

    max_new_tokens: int = 4096
    temperature: float = 0.0
    """0 = greedy."""
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.repetition_penalty <= 0:
            raise ValueError(f"invalid talker sampling params {self}")


@dataclass
class TalkerOutput:
    frames: list[list[int]]
    """One `[code_0, ..., code_{G-1}]` per audio frame."""
    finish_reason: str
    """"stop" (codec EOS) or "length"."""
    stage_durations: dict[str, float] = field(default_factory=dict)


class Qwen3OmniTalker(nn.Module):
    def __init__(self, config) -> None:
        """`config` is the checkpoint's full `Qwen3OmniMoeConfig` (the talker reads thinker ids too)."""
        super().__init__()
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerForConditionalGeneration,
        )

        self.config = config
        talker_config = config.talker_config
        self.talker = Qwen3OmniMoeTalkerForConditionalGeneration._from_config(talker_config)
        text = config.thinker_config.text_config
        # The talker's text conditioning is the thinker's input embedding of each token.
        self.thinker_embed = nn.Embedding(text.vocab_size, text.hidden_size)
        self.codec_eos = talker_config.codec_eos_token_id
        vocab = talker_config.text_config.vocab_size
        # Only codebook entries and codec EOS may be generated (as in transformers' generate).
        allowed = torch.ones(vocab, dtype=torch.bool)
        allowed[vocab - 1024:] = False
        allowed[self.codec_eos] = True
        self.register_buffer("allowed", allowed, persistent=False)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> Qwen3OmniTalker:
        from transformers import AutoConfig

        model_dir = Path(model_dir)
        model = cls(AutoConfig.from_pretrained(model_dir)).to(device=device, dtype=dtype)
        load_into(model.talker, fuse_experts(iter_prefixed_weights(model_dir, ("talker.",))), strip="talker.")
        embed = "thinker.model.embed_tokens.weight"
        load_into(model.thinker_embed, iter_prefixed_weights(model_dir, (embed,)), strip=embed.removesuffix("weight"))
        return model.eval()

    # ---- inputs ------------------------------------------------------------------------------------------
    def _project_text(self, thinker_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(thinker_ids, dtype=torch.long, device=self.allowed.device)
        return self.talker.text_projection(self.thinker_embed(ids))

    def prompt_embeds(self, prompt: TalkerPrompt) -> torch.Tensor:
        """(P, D) talker prompt embeddings: projected thinker token embeddings plus the codec preamble."""
        if prompt.multimodal_positions:
            # Audio/image/video placeholders need the thinker's accept_hidden_layer states and M-RoPE positions:
            # the vLLM talker stage takes them (thinker_hidden.py); this in-process variant does not.
            raise ValueError("talker prompt has multimodal positions; the in-process talker takes text prompts only "
                             "(the vLLM talker stage takes media)")
        embeds = self._project_text(prompt.thinker_ids)
        codec = torch.tensor(prompt.codec_ids, device=embeds.device)
        has_codec = codec != NO_CODEC
        embeds[has_codec] += self.talker.get_input_embeddings()(codec[has_codec])
        return embeds

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(self, prompt: TalkerPrompt, params: TalkerSamplingParams | None = None) -> TalkerOutput:
        start = time.perf_counter()
        frames: list[list[int]] = []
        stream = self.iter_frames(prompt, params)
        while True:
            try:
                frames.append(next(stream))
            except StopIteration as stop:
                return TalkerOutput(frames=frames, finish_reason=stop.value,
                                    stage_durations={"talker": time.perf_counter() - start})

    @torch.inference_mode()
    def iter_frames(self, prompt: TalkerPrompt,
                    params: TalkerSamplingParams | None = None) -> Generator[list[int], None, str]:
        """Yield each frame `[code_0, ..., code_{G-1}]` as soon as it is complete (for streaming audio);
        returns the finish reason ("stop" = codec EOS, "length")."""
        from transformers import DynamicCache

        params = params or TalkerSamplingParams()
        sample = CodecSampler(params, self.allowed)
        trailing = self._project_text(prompt.trailing_thinker_ids)
        tts_pad = self._project_text([prompt.tts_pad_id])[0]
        inputs = self.prompt_embeds(prompt).unsqueeze(0)
        cache = DynamicCache(config=self.talker.config.text_config)
        generated: list[int] = []
        for step in range(params.max_new_tokens):
            past = cache.get_seq_length()
            positions = torch.arange(past, past + inputs.shape[1], device=inputs.device).view(1, 1, -1).expand(3, 1, -1)
            hidden = self.talker.model(inputs_embeds=inputs, position_ids=positions, past_key_values=cache,
                                       use_cache=True).last_hidden_state[:, -1]
            code0 = sample(self.talker.codec_head(hidden), generated)
            generated.append(int(code0))
            if int(code0) == self.codec_eos:
                return "stop"
            if step == params.max_new_tokens - 1:
                break  # a frame's residual codes are only drawn when it is fed back
            code0_embed = self.talker.get_input_embeddings()(code0)
            residual, frame_embed = predict_residual_codes(self.talker.code_predictor, hidden[0], code0_embed,
                                                           lambda logits: sample(logits, None))
            yield [int(code0), *residual]
            text = trailing[step] if step < trailing.shape[0] else tts_pad
            inputs = (frame_embed + text).view(1, 1, -1)
        return "length"


def predict_residual_codes(predictor, past_hidden: torch.Tensor, code0_embed: torch.Tensor,
                           pick: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[int], torch.Tensor]:
    """The MTP step of one frame: codebooks 1..G-1 from the backbone's last hidden state (D,) and codebook 0's
    embedding (D,), one code predictor step each; returns them and the frame's summed codec embedding (D,),
    the next backbone input before the text conditioning. `pick` turns a logits row into a code."""
    from transformers import DynamicCache

    inputs = torch.stack((past_hidden, code0_embed)).unsqueeze(0)
    cache = DynamicCache(config=predictor.config)
    total = code0_embed.clone()
    codes = []
    for group in range(1, predictor.config.num_code_groups):
        hidden = predictor.model(inputs_embeds=inputs, past_key_values=cache, use_cache=True).last_hidden_state
        code = pick(predictor.lm_head[group - 1](hidden[:, -1]))
        codes.append(int(code))
        inputs = predictor.model.codec_embedding[group - 1](code.view(1, 1))
        total = total + inputs[0, 0]
    return codes, total


class CodecSampler:
    """Greedy / top-k / top-p over one row of logits; the talker's codebook-0 calls pass its history (for the
    repetition penalty) and are restricted to codec ids, the code predictor's calls pass None."""

    def __init__(self, params: TalkerSamplingParams, allowed: torch.Tensor | None) -> None:
        self.params = params
        self.allowed = allowed
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor, history: list[int] | None) -> torch.Tensor:
        logits = logits.reshape(-1).float()
        if history is not None:
            if history and self.params.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(history)), device=logits.device)
                scores = logits[seen]
                logits[seen] = torch.where(scores < 0, scores * self.params.repetition_penalty,
                                           scores / self.params.repetition_penalty)
            logits = logits.masked_fill(~self.allowed, float("-inf"))
        if self.generator is None:
            return logits.argmax()
        logits = logits / self.params.temperature
        if self.params.top_k > 0:
            kth = torch.topk(logits, min(self.params.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(0) - sorted_probs > self.params.top_p
            probs[order[drop]] = 0
            probs = probs / probs.sum()
        return torch.multinomial(probs.cpu(), 1, generator=self.generator)[0].to(logits.device)
