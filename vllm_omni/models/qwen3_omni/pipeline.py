"""The Qwen3-Omni pipeline: thinker (AR) -> talker (AR, our vLLM model) -> code2wav (GENERATION).

The thinker answers in text (a final output); its prompt and answer token ids become the talker's
conditioning, set per request through the talker's SamplingParams (`extra_args`); the talker's codec frames,
kept in its worker, are cut into vocoder chunks by the edge's `chunk_schedule` (default `CODE2WAV_CHUNK_SCHEDULE`:
a short first chunk, then longer ones, each with the model's left context) for code2wav, whose waveform is the
audio output. Both edges stream: the talker starts after the thinker's first tokens and gets the rest as they
come; a vocoder chunk is decoded as soon as the talker has made its frames (`stream=False`: each stage once its
upstream finished; the same frames, chunks and audio, greedy).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from vllm_omni.catalog.edges import StageInput, StageInputContext, reads
from vllm_omni.config.pipeline_config import (
    EdgeStreamConfig,
    PipelineConfig,
    PipelineStageConfig,
    StageExecutionType,
)
from vllm_omni.connectors.base import StagePayload
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.voices import resolve_voice
from vllm_omni.logger import init_logger
from vllm_omni.models.qwen3_omni.stage_input_processors import (
    Qwen3OmniTokenIds,
    talker_to_code2wav,
    thinker_to_talker,
)

if TYPE_CHECKING:
    from vllm_omni.models.qwen3_omni.talker import TalkerSamplingParams

logger = init_logger(__name__)

DEFAULT_SPEAKER = "ethan"
THINKER_ARCHITECTURE = "Qwen3OmniMoeOmniThinkerForConditionalGeneration"
"""vllm_thinker.py's name for vLLM's thinker (kept here so the topology imports no vLLM model code)."""
TALKER_DEFAULT_SAMPLING = {"max_tokens": 4096, "temperature": 0.9, "top_k": 50, "top_p": 1.0,
                           "repetition_penalty": 1.05}
"""The talker's decoding when a request names none: transformers' `Qwen3OmniMoeForConditionalGeneration.generate`
defaults (greedy talkers tend to loop)."""
THINKER_FIRST_CHUNK_TOKENS = 4
"""Thinker tokens before the talker starts (it needs 3 to be prompted)."""
THINKER_CHUNK_TOKENS = 16
"""Thinker tokens between its later updates to the talker while the talker is busy, and the most a waiting talker
waits for (it gets the thinker's newest tokens once they are as many as those it has: `THINKER_IDLE_CHUNK_GROWTH`).
"""
THINKER_IDLE_CHUNK_GROWTH = 1.0
"""A waiting talker's next input chunk needs as many new thinker tokens as it has already (at most
`THINKER_CHUNK_TOKENS`): hand-offs after 4, 8, 16, then every 16 thinker tokens, so a reply of N >= 16 tokens costs
the talker at most 2 + ceil(N / 16) input chunks (32 tokens: 4, 6 requests to the EngineCores with the thinker's
and the talker's input close) however fast either stage runs, where handing on at once cost one chunk per two or
three thinker tokens when the talker is the faster stage. The second hand-off (8 tokens: 7 talker frames) comes at
the thinker token the first audio (6 talker frames: the talker -> code2wav edge's first hand-off) waited for then
too; the talker decodes 4 frames after it instead of 2."""
CODE2WAV_CHUNK_SCHEDULE = (4, 8, 16, 32)
"""Codec frames per vocoder chunk, the last size repeating (12.5 frames/s): the first audio needs 4 frames (0.32
s), later chunks grow so that the left context is recomputed less often."""
CODE2WAV_LEFT_CONTEXT = 25
"""Frames of left context per chunk: transformers' `Qwen3OmniMoeCode2Wav.chunked_decode` default."""
TALKER_CHUNK_TOKENS = 4
"""Talker tokens between looks at its frames (in-band with its outputs): a vocoder chunk is handed on at most this
many frames after it is complete."""
FRAMES_TIMEOUT_S = 10.0
"""How long the collector waits for the thinker worker's capture when it asks for it (a merged output)."""


def qwen3_omni_pipeline(stream: bool = True, chunk_tokens: int = THINKER_CHUNK_TOKENS,
                        first_chunk_tokens: int = THINKER_FIRST_CHUNK_TOKENS,
                        vocoder_chunks: tuple[int, ...] = CODE2WAV_CHUNK_SCHEDULE,
                        idle_chunk_growth: float = THINKER_IDLE_CHUNK_GROWTH) -> PipelineConfig:
    """`stream`: the talker starts after the thinker's first `first_chunk_tokens` tokens (then gets them every
    `chunk_tokens`, or sooner by `idle_chunk_growth` when it waits) and code2wav decodes each vocoder chunk
    (`vocoder_chunks` frames, the last size repeating) while the talker runs (False: each stage once its upstream
    finished; the same chunks)."""
    from vllm_omni.models.qwen3_omni.thinker_hidden import thinker_engine_kwargs
    from vllm_omni.models.qwen3_omni.vllm_talker import talker_engine_kwargs

    # The worker has filed all frames but the newest token's, and the newest filed one is kept back: the first
    # vocoder chunk is complete two talker tokens after its frames.
    hand_offs = {"chunk_tokens": TALKER_CHUNK_TOKENS, "first_chunk_tokens": vocoder_chunks[0] + 2} if stream else {}
    to_code2wav = EdgeStreamConfig(stream=stream, chunk_schedule=list(vocoder_chunks), **hand_offs)
    to_talker = (EdgeStreamConfig(chunk_tokens=chunk_tokens, first_chunk_tokens=first_chunk_tokens,
                                  idle_chunk_growth=idle_chunk_growth) if stream
                 else EdgeStreamConfig(stream=False))

    ar, generation = StageExecutionType.AR, StageExecutionType.GENERATION
    return PipelineConfig(name="qwen3_omni", stages=[
        # vLLM's thinker with a processor that also works without torchvision; it exports the hidden states the
        # talker takes at multimodal positions (vllm_thinker.py, thinker_hidden.py).
        PipelineStageConfig(stage_id=0, execution_type=ar, final_output=True, final_output_type="text",
                            output_collector="qwen3_omni_thinker_hidden",
                            engine_args={"hf_overrides": {"architectures": [THINKER_ARCHITECTURE]},
                                         **thinker_engine_kwargs()}),
        PipelineStageConfig(stage_id=1, execution_type=ar, inputs=[0], input_processor="qwen3_omni_thinker_to_talker",
                            stream_inputs={0: to_talker},
                            output_collector="qwen3_omni_talker_frames", engine_args=talker_engine_kwargs(),
                            default_sampling_params=TALKER_DEFAULT_SAMPLING),
        PipelineStageConfig(stage_id=2, execution_type=generation, inputs=[1],
                            stream_inputs={1: to_code2wav},
                            input_processor="qwen3_omni_talker_to_code2wav", final_output=True,
                            final_output_type="audio",
                            engine_args={"model_class": "vllm_omni.models.qwen3_omni.code2wav:"
                                                        "Qwen3OmniCode2Wav"}),
    ])


@functools.cache
def _hf_config(model_path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


@reads(partial_stage_data="first_chunk")  # the thinker's prompt capture, complete with its first token
def thinker_to_talker_request(upstream: list[StagePayload], original_prompt: Any,
                              context: StageInputContext) -> StageInput | None:
    """The talker's placeholder prompt and params carrying its conditioning; `voice` picks the speaker.

    Of the caller's talker `SamplingParams`: `max_tokens` (codec frames) and `temperature` / `top_k` / `top_p` /
    `repetition_penalty` / `seed` (temperature 0 = greedy). On a streamed edge: the talker's next input chunk."""
    from vllm.sampling_params import RequestOutputKind

    from vllm_omni.models.qwen3_omni.vllm_talker import talker_request

    if context.edge is not None and context.edge.stream:
        return _talker_input_chunk(upstream, original_prompt, context)
    config, ids, voice, sampling = _talker_setup(original_prompt, context)
    thinker = upstream[0].metadata
    prompt = _talker_prompt(thinker, ids, voice)
    vllm_prompt, params = talker_request(prompt, context.request_id, config.talker_config,
                                         max_new_tokens=sampling.max_new_tokens, sampling=sampling,
                                         thinker_hidden=_thinker_hidden(thinker, prompt))
    params.output_kind = RequestOutputKind.FINAL_ONLY  # only the finished frames feed on
    return StageInput(vllm_prompt, params)


def _talker_setup(original_prompt: Any, context: StageInputContext) -> tuple[Any, Qwen3OmniTokenIds, str, Any]:
    config = _hf_config(context.stage.model)
    voice = original_prompt.get("voice") if isinstance(original_prompt, dict) else None
    ids = Qwen3OmniTokenIds.from_config(config)
    speaker = resolve_voice(voice, ids.speakers)  # OpenAI's voice names: the default speaker
    return config, ids, speaker or DEFAULT_SPEAKER, talker_sampling(context.sampling_params)


def _talker_prompt(thinker: dict[str, Any], ids: Qwen3OmniTokenIds, voice: str):
    try:
        prompt = thinker_to_talker(thinker["prompt_token_ids"], thinker["token_ids"], ids, speaker=voice)
    except ValueError as e:
        raise OmniClientError(f"talker input: {e}", param="prompt") from e
    return prompt


def _thinker_hidden(thinker: dict[str, Any], prompt) -> dict[str, Any] | None:
    """The thinker's capture (thinker_hidden.py) when the talker prompt has multimodal positions."""
    if not prompt.multimodal_positions:
        return None
    capture = (thinker.get("stage_data") or {}).get("thinker_hidden")
    if capture is None:
        raise RuntimeError("the thinker exported no hidden states for a prompt with audio / image / video")
    return capture


def _talker_input_chunk(upstream: list[StagePayload], original_prompt: Any,
                        context: StageInputContext) -> StageInput | None:
    """The talker's next input chunk while the thinker answers (a vLLM streaming-input request).

    Decode step k conditions on trailing thinker token k, so the talker may sample one frame more than the
    trailing tokens known (the thinker's newest token is not known to be trailing until the next one, or the
    end, comes). vLLM ends each chunk at its `max_tokens` and drops its last sampled token, so the next chunk
    is that token again (as prompt) plus the longer trailing list, which the talker model reads from
    `extra_args`. The frames equal the store-and-forward run's (greedy)."""
    from vllm_omni.models.qwen3_omni.vllm_talker import talker_request

    state, thinker = context.state, upstream[0].metadata
    state.setdefault("stage_data", thinker["stage_data"])  # later chunks carry none (partial_stage_data)
    if "budget" not in state:
        if not context.final and len(thinker["token_ids"]) < max(context.edge.first_hand_off(), 3):
            return None
        state["config"], state["ids"], state["voice"], state["sampling"] = _talker_setup(original_prompt, context)
        prompt = _talker_prompt(thinker, state["ids"], state["voice"])
        state["hidden"] = _thinker_hidden({"stage_data": state["stage_data"]}, prompt)
        # vLLM stops a plain request at max_model_len, but a streaming-input chunk past it kills the EngineCore
        # ("Sampled token IDs exceed the max model length"): the budget stays inside it.
        max_len = (context.stage.engine_args.get("max_model_len")
                   or state["config"].talker_config.text_config.max_position_embeddings)
        state["budget"] = min(state["sampling"].max_new_tokens, max_len - len(prompt.thinker_ids))
    elif not context.idle:
        return None  # the talker is decoding its last chunk
    config, generated = state["config"], context.output_token_ids
    if generated and (generated[-1] == config.talker_config.codec_eos_token_id or len(generated) >= state["budget"]):
        return StageInput(None, None)
    prompt = _talker_prompt(thinker, state["ids"], state["voice"])
    if not context.final:
        prompt.trailing_thinker_ids = prompt.trailing_thinker_ids[:-1]  # the end marker is not known yet
    room = state["budget"] - len(generated)
    frames = room if context.final else min(len(prompt.trailing_thinker_ids) - len(generated) + 1, room)
    if frames < (1 if context.final else 2):
        return None
    vllm_prompt, params = talker_request(prompt, context.request_id, config.talker_config, max_new_tokens=frames,
                                         sampling=state["sampling"], thinker_hidden=state["hidden"])
    if generated:
        vllm_prompt = {"prompt_token_ids": [generated[-1]]}
    return StageInput(vllm_prompt, params)


def talker_sampling(params: Any) -> TalkerSamplingParams:
    """The talker's decoding from the caller's stage-1 `SamplingParams` (None: greedy, 4096 frames at most)."""
    from vllm_omni.models.qwen3_omni.talker import TalkerSamplingParams

    fields: dict[str, Any] = {"max_new_tokens": getattr(params, "max_tokens", None) or 4096}
    temperature = getattr(params, "temperature", 0.0) or 0.0
    if temperature > 0:
        fields.update(temperature=temperature, top_k=max(getattr(params, "top_k", 0) or 0, 0),
                      top_p=getattr(params, "top_p", 1.0), seed=getattr(params, "seed", None),
                      repetition_penalty=getattr(params, "repetition_penalty", 1.0))
    try:
        return TalkerSamplingParams(**fields)
    except ValueError as e:
        raise OmniClientError(f"talker sampling params: {e}", param="sampling_params_list") from e


async def collect_thinker_hidden(client: Any, request_id: str, output: Any) -> dict[str, Any]:
    """The thinker's prompt capture (M-RoPE positions, hidden states at multimodal positions), in-band on the
    output of the step that completed it and on the last one (thinker_hidden.py). Should vLLM have merged that
    output into a later one, a running request's capture is asked of the worker once."""
    capture = output.stage_data.get("thinker_hidden")
    if capture is None and not output.finished:
        logger.debug("thinker capture of request %s merged away; asking the worker", request_id)
        (taken,) = await client.collective_rpc_async("take_thinker_hidden", timeout=FRAMES_TIMEOUT_S,
                                                     args=([request_id], True))
        capture = output.stage_data["thinker_hidden"] = taken[request_id]
    return {"thinker_hidden": capture}


async def collect_talker_frames(client: Any, request_id: str, output: Any) -> dict[str, Any]:
    """The request's codec frames, in-band with its outputs (talker_rows.py): those complete so far while it
    runs (a streamed edge), all of them once it finished."""
    from vllm_omni.models.qwen3_omni.talker_rows import frames_from_stage_data

    return {"codec_frames": frames_from_stage_data(output.stage_data)}


@reads(edge_fields=("chunk_schedule",))
def talker_to_code2wav_chunks(upstream: list[StagePayload], original_prompt: Any,
                              context: StageInputContext) -> list | None:
    """The vocoder chunks not handed on yet; while the talker runs only full chunks, and never its newest frame,
    so the final call always has one chunk to end the stream with (None: no full chunk yet)."""
    frames = upstream[0].metadata["stage_data"].get("codec_frames") or []
    if context.final and not frames:
        raise RuntimeError("the talker produced no codec frames")
    start = context.state.get("next_frame", 0)
    ready = frames if context.final else frames[:-1]
    schedule = (context.edge.chunk_schedule if context.edge is not None else None) or CODE2WAV_CHUNK_SCHEDULE
    chunks = talker_to_code2wav(ready, chunk_size=schedule, left_context=CODE2WAV_LEFT_CONTEXT,
                                start_frame=start, final=context.final)
    context.state["next_frame"] = start + sum(len(c.codes[0]) - c.context for c in chunks)
    return chunks or None
