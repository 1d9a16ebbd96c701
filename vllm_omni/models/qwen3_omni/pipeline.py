"""The Qwen3-Omni pipeline: thinker (AR) -> talker (AR, our vLLM model) -> code2wav (GENERATION).

The thinker answers in text (a final output); its prompt and answer token ids become the talker's
conditioning, set per request through the talker's SamplingParams (`extra_args`); the talker's codec frames,
kept in its worker, are collected once the request finishes and cut into vocoder chunks for code2wav, whose
waveform is the audio output.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING, Any

from vllm_omni.config.pipeline_config import PipelineConfig, PipelineStageConfig, StageExecutionType
from vllm_omni.connectors.base import StagePayload
from vllm_omni.engine.stage_input_processors import StageInput, StageInputContext
from vllm_omni.errors import OmniClientError
from vllm_omni.models.qwen3_omni.stage_input_processors import (
    Qwen3OmniTokenIds,
    talker_to_code2wav,
    thinker_to_talker,
)

if TYPE_CHECKING:
    from vllm_omni.models.qwen3_omni.talker import TalkerSamplingParams

DEFAULT_SPEAKER = "ethan"
TALKER_DEFAULT_SAMPLING = {"max_tokens": 4096, "temperature": 0.9, "top_k": 50, "top_p": 1.0,
                           "repetition_penalty": 1.05}
"""The talker's decoding when a request names none: transformers' `Qwen3OmniMoeForConditionalGeneration.generate`
defaults (greedy talkers tend to loop)."""
FRAMES_TIMEOUT_S = 10.0
"""How long the collector waits for the talker worker to file a finished request's frames (one engine step)."""


def qwen3_omni_pipeline() -> PipelineConfig:
    from vllm_omni.models.qwen3_omni.vllm_talker import talker_engine_kwargs

    ar, generation = StageExecutionType.AR, StageExecutionType.GENERATION
    return PipelineConfig(name="qwen3_omni", stages=[
        # The talker takes text prompts only so far, so the thinker's multimodal inputs are off.
        PipelineStageConfig(stage_id=0, execution_type=ar, final_output=True, final_output_type="text",
                            engine_args={"limit_mm_per_prompt": {"image": 0, "video": 0, "audio": 0}}),
        PipelineStageConfig(stage_id=1, execution_type=ar, inputs=[0], input_processor="qwen3_omni_thinker_to_talker",
                            output_collector="qwen3_omni_talker_frames", engine_args=talker_engine_kwargs(),
                            default_sampling_params=TALKER_DEFAULT_SAMPLING),
        PipelineStageConfig(stage_id=2, execution_type=generation, inputs=[1],
                            input_processor="qwen3_omni_talker_to_code2wav", final_output=True,
                            final_output_type="audio",
                            engine_args={"model_class": "vllm_omni.models.qwen3_omni.code2wav:"
                                                        "Qwen3OmniCode2Wav"}),
    ])


@functools.cache
def _hf_config(model_path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def thinker_to_talker_request(upstream: list[StagePayload], original_prompt: Any,
                              context: StageInputContext) -> StageInput:
    """The talker's placeholder prompt and params carrying its conditioning; `voice` picks the speaker.

    Of the caller's talker `SamplingParams`: `max_tokens` (codec frames) and `temperature` / `top_k` / `top_p` /
    `repetition_penalty` / `seed` (temperature 0 = greedy)."""
    from vllm.sampling_params import RequestOutputKind

    from vllm_omni.inputs.voices import resolve_voice
    from vllm_omni.models.qwen3_omni.vllm_talker import talker_request

    config = _hf_config(context.stage.model)
    voice = original_prompt.get("voice") if isinstance(original_prompt, dict) else None
    ids = Qwen3OmniTokenIds.from_config(config)
    speaker = resolve_voice(voice, ids.speakers)
    sampling = _talker_sampling(context.sampling_params)
    thinker = upstream[0].metadata
    try:
        prompt = thinker_to_talker(thinker["prompt_token_ids"], thinker["token_ids"], ids,
                                   speaker=speaker or DEFAULT_SPEAKER)
    except ValueError as e:
        raise OmniClientError(f"talker input: {e}", param="prompt") from e
    vllm_prompt, params = talker_request(prompt, context.request_id, config.talker_config,
                                         max_new_tokens=sampling.max_new_tokens, sampling=sampling)
    params.output_kind = RequestOutputKind.FINAL_ONLY  # only the finished frames feed on
    return StageInput(vllm_prompt, params)


def _talker_sampling(params: Any) -> TalkerSamplingParams:
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


async def collect_talker_frames(client: Any, request_id: str, output: Any) -> dict[str, Any]:
    """The finished request's codec frames from the talker worker. The worker files them on the engine step
    after the last token, which may run just after vLLM returned the output: poll briefly."""
    deadline = time.monotonic() + FRAMES_TIMEOUT_S
    while True:
        (taken,) = await client.collective_rpc_async("take_talker_frames", timeout=FRAMES_TIMEOUT_S,
                                                     args=([request_id],))
        frames = taken[request_id]
        if frames is not None:
            return {"codec_frames": frames}
        if time.monotonic() > deadline:
            raise RuntimeError(f"talker frames of request {request_id} not filed within {FRAMES_TIMEOUT_S} s")
        await asyncio.sleep(0.01)


def talker_to_code2wav_chunks(upstream: list[StagePayload], original_prompt: Any, context: StageInputContext) -> list:
    frames = upstream[0].metadata["stage_data"].get("codec_frames") or []
    if not frames:
        raise RuntimeError("the talker produced no codec frames")
    return talker_to_code2wav(frames)
