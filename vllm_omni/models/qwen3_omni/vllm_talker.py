"""Qwen3-Omni talker as a vLLM model: vLLM's Qwen3-MoE decoder (paged KV cache, fused MoE) for codebook 0,
plus the MTP code predictor run inside the forward for each decode token.

vLLM gives a model forward no request identity, but the talker needs per-request inputs at every decode step
(the next answer token from the thinker, the previous step's last hidden state for the code predictor) and
produces G-1 extra codes per step. The stage's KV-connector plugin (talker_rows.py) tells the model which request
owns which rows of each forward and which requests finished; requests carry their conditioning in
`SamplingParams.extra_args["qwen3_omni_talker"]` (a `TalkerPrompt` as builtins plus a `key`); each completed
frame goes out in-band with the step's output (talker_rows.py), and a worker-extension method
(`take_talker_frames`) serves finished requests' frames to direct callers.

The stage's vLLM config is the checkpoint with `hf_overrides=talker_hf_overrides`, which hands vLLM the talker's
config (so KV cache, vocabulary and max length are the talker's). Its RoPE is the talker's M-RoPE, built here
and not announced to vLLM (vLLM's runner would then want the positions from multimodal features the talker never
gets): text-only prompts rotate with the runner's plain positions (equal temporal/height/width positions are the
same rotation); a prompt with audio / image / video brings its M-RoPE positions and decode delta in `extra_args`
(derived from the thinker's, `talker_mrope_positions`), and its multimodal positions take `hidden_projection` of the
thinker's `accept_hidden_layer` states exported by the thinker stage (thinker_hidden.py), as in transformers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_omni.models.qwen3_omni.stage_input_processors import NO_CODEC, TalkerPrompt, talker_mrope_positions
from vllm_omni.models.qwen3_omni.talker import (
    CodecSampler,
    TalkerSamplingParams,
    predict_residual_codes,
)
from vllm_omni.models.qwen3_omni.talker_rows import RequestRows, talker_rows_engine_kwargs

EXTRA_ARGS_KEY = "qwen3_omni_talker"
MAX_UNCLAIMED_RESULTS = 4096
ARCHITECTURE = "Qwen3OmniMoeTalkerForConditionalGeneration"


def talker_hf_overrides(config):
    """vLLM `hf_overrides` for the talker stage: the talker's config, with the few thinker facts it needs."""
    if getattr(config, "talker_config", None) is None:  # vLLM also probes the hook with a placeholder config
        return config
    talker = copy.deepcopy(config.talker_config)
    thinker_text = config.thinker_config.text_config
    talker.architectures = [ARCHITECTURE]
    talker.thinker_vocab_size = thinker_text.vocab_size
    text = talker.text_config
    rope = dict(text.rope_parameters or {})
    talker.talker_mrope_parameters = dict(rope)
    for key in ("mrope_section", "interleaved", "mrope_interleaved"):
        rope.pop(key, None)
    text.rope_parameters = rope
    return talker


@dataclass
class _RequestState:
    key: str
    thinker_ids: torch.Tensor
    codec_ids: torch.Tensor
    trailing_ids: list[int]
    tts_pad_id: int
    mm_rows: torch.Tensor | None = None
    """Per prompt position: the row of `mm_embeds` it takes (-1: text)."""
    mm_embeds: torch.Tensor | None = None
    """hidden_projection of the thinker's states at the multimodal positions (M, D)."""
    mrope_positions: torch.Tensor | None = None
    """(3, P) M-RoPE positions of the prompt; decode position p rotates as p + mrope_delta (None: plain)."""
    mrope_delta: int = 0
    last_hidden: torch.Tensor | None = None
    frames: list[list[int]] = field(default_factory=list)
    frame_embeds: list[torch.Tensor] = field(default_factory=list)
    error: str | None = None
    pick_code: Callable[[torch.Tensor], torch.Tensor] = lambda logits: logits.argmax(dim=-1)
    """Codebooks 1..G-1 (the code predictor): greedy, or sampled when the request samples codebook 0."""


class CodecTalkerBase(nn.Module):
    """The request-identity machinery of a codec talker on vLLM (shared with Qwen3-TTS's talker): per-request
    conditioning from `extra_args`, the code predictor per decode token, the frames collected by RPC. A subclass
    builds `model` (a vLLM decoder over codec ids), `codec_head`, `logits_processor`, `code_predictor` and
    `codec_eos`, and says how a text id is embedded (`_project`)."""

    def __init__(self) -> None:
        super().__init__()
        self._requests: dict[str, _RequestState] = {}
        self._finished: dict[str, list[list[int]]] = {}

    # ---- request identity (talker_rows.py) ------------------------------------------------------------
    @staticmethod
    def _connector():
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        from vllm_omni.models.qwen3_omni.talker_rows import TalkerRowsConnector

        connector = get_kv_transfer_group() if has_kv_transfer_group() else None
        return connector if isinstance(connector, TalkerRowsConnector) else None

    def sync_finished(self) -> None:
        """File the frames of requests the scheduler reported finished."""
        if (connector := self._connector()) is not None:
            self.finish_requests(connector.drain_finished())

    def _step_rows(self) -> list[RequestRows]:
        from vllm.forward_context import get_forward_context

        connector = self._connector()
        if connector is None:
            return []
        self.finish_requests(connector.drain_finished())
        slots = get_forward_context().slot_mapping
        if not slots or isinstance(slots, list):  # no KV this forward (profiling), or micro-batches (unused)
            return []
        return connector.request_rows(next(iter(slots.values())))

    def finish_requests(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            state = self._requests.pop(req_id, None)
            if state is not None:
                self._finished[state.key] = state.error or state.frames
        while len(self._finished) > MAX_UNCLAIMED_RESULTS:  # never-collected results must not pile up
            self._finished.pop(next(iter(self._finished)))

    def take_frames(self, keys: list[str]) -> dict[str, list[list[int]] | None]:
        """Frames of finished requests (None for keys not finished or unknown)."""
        taken = {key: self._finished.pop(key, None) for key in keys}
        errors = [f"{key}: {v}" for key, v in taken.items() if isinstance(v, str)]
        if errors:
            raise RuntimeError("talker request(s) failed: " + "; ".join(errors))
        return taken

    def peek_frames(self, keys: list[str]) -> dict[str, list[list[int]]]:
        """Frames of running (or finished, not yet taken) requests so far, for a streamed edge: frame k is
        complete once the step after it ran (its residual codes are predicted there)."""
        running = {state.key: state for state in self._requests.values()}
        peeked = {}
        for key in keys:
            found = running[key].frames if key in running else self._finished.get(key)
            peeked[key] = list(found) if isinstance(found, list) else []
        return peeked

    # ---- vLLM model interface --------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        rows = self._step_rows()
        for row in rows:
            self._condition_row(row, input_ids, positions, inputs_embeds, self._connector())
        hidden = self.model(None, self._rope_positions(rows, positions), intermediate_tensors,
                            inputs_embeds=inputs_embeds)
        for row in rows:
            state = self._requests.get(row.req_id)
            if state is not None:
                state.last_hidden = hidden[row.end - 1].clone()
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.codec_head, hidden_states)

    def _rope_positions(self, rows: list[RequestRows], positions: torch.Tensor) -> torch.Tensor:
        """(3, N) M-RoPE positions when a row's request has multimodal input, else the runner's (N,)."""
        states = [(row, self._requests.get(row.req_id)) for row in rows]
        states = [(row, s) for row, s in states if s is not None and s.mrope_positions is not None]
        if not states or positions.dim() != 1:
            return positions
        rope = positions.unsqueeze(0).expand(3, -1).clone()
        for row, state in states:
            pos = positions[row.start:row.end]
            prompt = pos < state.mrope_positions.shape[1]
            span = rope[:, row.start:row.end]
            span[:, prompt] = state.mrope_positions[:, pos[prompt]]
            span[:, ~prompt] = pos[~prompt] + state.mrope_delta
        return rope

    # ---- per-request conditioning ------------------------------------------------------------------------
    def _state(self, row: RequestRows, device) -> _RequestState | None:
        state = self._requests.get(row.req_id)
        if state is None and row.extra_args and EXTRA_ARGS_KEY in row.extra_args:
            spec = row.extra_args[EXTRA_ARGS_KEY]
            state = _RequestState(
                key=str(spec["key"]),
                thinker_ids=torch.tensor(spec["thinker_ids"], dtype=torch.long, device=device),
                codec_ids=torch.tensor(spec["codec_ids"], dtype=torch.long, device=device),
                trailing_ids=list(spec["trailing_thinker_ids"]), tts_pad_id=int(spec["tts_pad_id"]))
            if spec.get("thinker_hidden") is not None:
                self._bind_thinker_hidden(state, spec, device)
            if spec.get("code_sampling"):
                sampler = CodecSampler(TalkerSamplingParams(**spec["code_sampling"]), allowed=None)
                state.pick_code = lambda logits: sampler(logits, None)
            self._requests[row.req_id] = state
        elif state is not None and row.extra_args and EXTRA_ARGS_KEY in row.extra_args:
            # A streamed request's later input chunks carry the thinker's answer as far as it is known.
            trailing = row.extra_args[EXTRA_ARGS_KEY]["trailing_thinker_ids"]
            if len(trailing) > len(state.trailing_ids):
                state.trailing_ids = list(trailing)
        return state

    def _bind_thinker_hidden(self, state: _RequestState, spec: dict, device) -> None:
        hidden = spec["thinker_hidden"]
        mm_rows = torch.full((state.thinker_ids.shape[0],), -1, dtype=torch.long, device=device)
        mm_rows[torch.tensor(spec["multimodal_positions"], dtype=torch.long, device=device)] = torch.arange(
            len(spec["multimodal_positions"]), device=device)
        states = torch.frombuffer(bytearray(hidden["hidden"]), dtype=torch.float32).view(*hidden["hidden_shape"])
        dtype = self.hidden_projection.linear_fc1.weight.dtype
        state.mm_rows = mm_rows
        state.mm_embeds = self.hidden_projection(states.to(device=device, dtype=dtype))
        state.mrope_positions = torch.tensor(hidden["mrope_positions"], dtype=torch.long, device=device)
        state.mrope_delta = int(hidden["mrope_delta"])

    def _project(self, text_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _condition_row(self, row: RequestRows, input_ids, positions, embeds: torch.Tensor, connector) -> None:
        state = self._state(row, embeds.device)
        if state is None:
            return
        prompt_len = state.thinker_ids.shape[0]
        pos = positions[row.start:row.end]
        prompt = pos < prompt_len
        if prompt.any():  # (chunked) prefill: the talker prompt replaces the placeholder ids
            idx = pos[prompt]
            rows = torch.arange(row.start, row.end, device=embeds.device)[prompt]
            value = self._project(state.thinker_ids[idx])
            if state.mm_rows is not None:  # audio / image / video positions: the thinker's hidden states
                mm = state.mm_rows[idx]
                value[mm >= 0] = state.mm_embeds[mm[mm >= 0]].to(value.dtype)
            codec = state.codec_ids[idx]
            has_codec = codec != NO_CODEC
            value[has_codec] += self.model.embed_input_ids(codec[has_codec])
            embeds[rows] = value.to(embeds.dtype)
        decode = torch.nonzero(~prompt).flatten().tolist()
        for offset in decode:  # one token per step; several when vLLM recomputes a preempted request
            i = row.start + offset
            step = int(pos[offset]) - prompt_len
            code0 = int(input_ids[i]) if input_ids is not None else None
            if code0 == self.codec_eos:
                continue
            if step < len(state.frames):  # recomputed position: the frame is known
                frame_embed = state.frame_embeds[step]
            elif step == len(state.frames) and offset == 0 and state.last_hidden is not None:
                residual, frame_embed = predict_residual_codes(self.code_predictor, state.last_hidden, embeds[i],
                                                               state.pick_code)
                state.frames.append([code0, *residual])
                state.frame_embeds.append(frame_embed)
                connector.send(row.req_id, frame=state.frames[-1])
            else:
                # The code predictor needs the previous position's final hidden state, which a recompute chunk
                # only produces inside this very forward.
                state.error = state.error or f"position {int(pos[offset])} recomputed without its predecessor"
                connector.send(row.req_id, error=state.error)
                continue
            text_id = state.trailing_ids[step] if step < len(state.trailing_ids) else state.tts_pad_id
            text = self._project(torch.tensor([text_id], device=embeds.device))[0]
            embeds[i] = (frame_embed + text).to(embeds.dtype)



class Qwen3OmniMoeTalkerForConditionalGeneration(CodecTalkerBase):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
            Qwen3OmniMoeTalkerResizeMLP,
        )
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel

        config = vllm_config.model_config.hf_config
        text = config.text_config
        self.config = config
        self.model = Qwen3MoeModel(vllm_config=vllm_config, prefix="model")
        self.codec_head = ParallelLMHead(text.vocab_size, text.hidden_size, prefix="codec_head")
        self.logits_processor = LogitsProcessor(text.vocab_size)
        self.text_projection = Qwen3OmniMoeTalkerResizeMLP(config)
        self.hidden_projection = Qwen3OmniMoeTalkerResizeMLP(config)
        self._use_mrope(config, text)
        self.thinker_embed = nn.Embedding(config.thinker_vocab_size, config.thinker_hidden_size)
        # Tiny dense transformer over <= G+1 positions per frame: transformers' module, no paged cache needed.
        self.code_predictor = Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration._from_config(
            config.code_predictor_config)
        self.codec_eos = config.codec_eos_token_id

    def _use_mrope(self, config, text) -> None:
        from vllm.model_executor.layers.rotary_embedding import get_rope

        rope = getattr(config, "talker_mrope_parameters", None)
        if not rope or "mrope_section" not in rope:
            return
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        mrope = get_rope(head_dim, max_position=text.max_position_embeddings, rope_parameters=rope)
        for layer in self.model.layers:
            if hasattr(layer, "self_attn"):  # pipeline-parallel placeholders have none
                layer.self_attn.rotary_emb = mrope

    def _project(self, thinker_ids: torch.Tensor) -> torch.Tensor:
        return self.text_projection(self.thinker_embed(thinker_ids))

    # ---- weights -------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

        mapper = WeightsMapper(orig_to_new_prefix={
            "talker.model.codec_embedding.": "model.embed_tokens.",
            "talker.model.": "model.",
            "talker.codec_head.": "codec_head.",
            "talker.text_projection.": "text_projection.",
            "talker.hidden_projection.": "hidden_projection.",
            "talker.code_predictor.": "code_predictor.",
            "thinker.model.embed_tokens.": "thinker_embed.",
        })
        wanted = ("talker.model.", "talker.codec_head.", "talker.text_projection.", "talker.hidden_projection.",
                  "talker.code_predictor.",
                  "thinker.model.embed_tokens.")
        loader = AutoWeightsLoader(self)
        return loader.load_weights(((n, w) for n, w in weights if n.startswith(wanted)), mapper=mapper)


def talker_engine_kwargs() -> dict:
    """vLLM engine arguments of the talker stage: vLLM's own worker, with the request-identity connector and the
    frame RPCs (talker_rows.py). Prefix caching is off: talker prompts are placeholder ids whose meaning lives in
    `extra_args`; async scheduling is off so no step runs past a finished request; eager mode keeps CPU start-up
    short (the per-request conditioning runs outside the compiled decoder anyway)."""
    return {"hf_overrides": talker_hf_overrides, "skip_tokenizer_init": True, "enable_prefix_caching": False,
            "async_scheduling": False, "enforce_eager": True, **talker_rows_engine_kwargs()}


OMNI_CODE_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 0.8}
"""How transformers' Qwen3-Omni talker samples the code predictor."""


def talker_request(prompt: TalkerPrompt, key: str, talker_config, *, max_new_tokens: int = 4096,
                   sampling: TalkerSamplingParams | None = None, thinker_hidden: dict | None = None):
    """(vLLM prompt, SamplingParams) of one talker request; its frames are collected under `key`.

    `sampling` (None = greedy): vLLM's sampler draws codebook 0 with its temperature / top-k / top-p / repetition
    penalty / seed; the code predictor then samples the other codebooks as transformers does (top-k 50, top-p 0.8)
    from a generator seeded with the same seed, and decodes greedily when codebook 0 does. `thinker_hidden`: the
    thinker stage's capture (thinker_hidden.py), required when the prompt has multimodal positions.
    """
    if prompt.multimodal_positions and thinker_hidden is None:
        raise ValueError("talker prompt has multimodal positions but no thinker hidden states (thinker_hidden.py)")
    extra = {"thinker_hidden": _talker_hidden(thinker_hidden, prompt)} if prompt.multimodal_positions else {}
    return codec_talker_request(prompt, key, vocab_size=talker_config.text_config.vocab_size,
                                codec_eos=talker_config.codec_eos_token_id, max_new_tokens=max_new_tokens,
                                sampling=sampling, code_sampling=OMNI_CODE_SAMPLING, extra=extra)


def codec_talker_request(prompt: TalkerPrompt, key: str, *, vocab_size: int, codec_eos: int, max_new_tokens: int,
                         sampling: TalkerSamplingParams | None, code_sampling: dict, min_tokens: int = 0,
                         extra: dict | None = None):
    """(vLLM prompt, SamplingParams) of a `CodecTalkerBase` request: codebook 0 drawn by vLLM's sampler from the
    codebook entries and codec EOS (the top 1024 codec ids are specials), the code predictor sampled with
    `code_sampling` (temperature / top_k / top_p) when codebook 0 is, else greedy."""
    import msgspec
    from vllm import SamplingParams

    sampling = sampling or TalkerSamplingParams()
    spec = {"key": key, **msgspec.to_builtins(prompt), **(extra or {})}
    sample = sampling.temperature > 0
    if sample:
        spec["code_sampling"] = {**code_sampling, "seed": sampling.seed}
    params = SamplingParams(
        temperature=sampling.temperature, top_k=sampling.top_k if sample else 0, top_p=sampling.top_p,
        repetition_penalty=sampling.repetition_penalty, seed=sampling.seed, max_tokens=max_new_tokens,
        min_tokens=min_tokens, stop_token_ids=[codec_eos], detokenize=False,
        allowed_token_ids=[*range(vocab_size - 1024), codec_eos],  # codebook entries and codec EOS only
        extra_args={EXTRA_ARGS_KEY: spec})
    # Prompt embeddings come from `spec`, so the ids only hold places: one the sampler never allows, so vLLM's
    # repetition penalty (which counts prompt ids) weighs the generated codes alone, as transformers' does.
    placeholder = next(i for i in range(vocab_size - 1, vocab_size - 1025, -1) if i != codec_eos)
    return {"prompt_token_ids": [placeholder] * len(prompt.thinker_ids)}, params


def _talker_hidden(capture: dict, prompt: TalkerPrompt) -> dict:
    """The capture's rows for the talker prompt's multimodal positions, and the talker's M-RoPE positions."""
    import numpy as np

    rows = {p: i for i, p in enumerate(capture["multimodal_positions"])}
    missing = [p for p in prompt.multimodal_source_positions if p not in rows]
    if missing:
        raise ValueError(f"the thinker exported no hidden states for prompt positions {missing[:8]}")
    hidden = np.frombuffer(capture["hidden"], dtype=np.float32).reshape(capture["hidden_shape"])
    hidden = hidden[[rows[p] for p in prompt.multimodal_source_positions]]
    positions, delta = talker_mrope_positions(capture["positions"], prompt)
    return {"hidden": hidden.tobytes(), "hidden_shape": list(hidden.shape), "mrope_positions": positions,
            "mrope_delta": delta}
