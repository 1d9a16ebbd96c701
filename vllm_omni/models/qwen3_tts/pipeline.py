"""The Qwen3-TTS pipeline: talker (AR, our vLLM model, with the code predictor) -> speech decoder (GENERATION).

The talker is prompted from the request's text (the entry stage's input processor tokenizes it and builds the
placeholder prompt and its conditioning, prompt.py); its codec frames, kept in its worker, are cut into decoder
chunks (Qwen3-Omni's edge: a short first chunk, then longer ones, each with 25 frames of left context) which the
speech-tokenizer decoder turns into the audio output. The edge streams: a chunk is decoded as soon as the talker
has made its frames, while the talker still reads the rest of the text (`stream=False`: once the talker
finished; the same chunks and audio).

A request's prompt is the text, or a dict: `prompt` (the text), `voice` (a speaker of a CustomVoice checkpoint;
OpenAI's voice names select its first speaker), `instructions` (a VoiceDesign checkpoint's voice description,
or a 1.7B CustomVoice checkpoint's style instruction) and `language` ("auto" or one the checkpoint names).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from vllm_omni.catalog.edges import StageInput, StageInputContext
from vllm_omni.config.pipeline_config import (
    EdgeStreamConfig,
    PipelineConfig,
    PipelineStageConfig,
    StageExecutionType,
)
from vllm_omni.connectors.base import StagePayload
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.voices import resolve_voice
from vllm_omni.models.qwen3_omni.pipeline import CODE2WAV_CHUNK_SCHEDULE, TALKER_CHUNK_TOKENS, talker_sampling
from vllm_omni.models.qwen3_tts.prompt import Qwen3TTSTokenIds, instruction_text, speech_text, talker_prompt

TALKER_DEFAULT_SAMPLING = {"max_tokens": 4096, "temperature": 0.9, "top_k": 50, "top_p": 1.0,
                           "repetition_penalty": 1.05}
"""The talker's decoding when a request names none: the checkpoints' `generation_config.json`."""
CODE_PREDICTOR_SAMPLING = {"temperature": 0.9, "top_k": 50, "top_p": 1.0}
"""The code predictor's when the talker samples (the checkpoints' `subtalker_*` defaults)."""
MIN_FRAMES = 2
"""The reference's `min_new_tokens`: codec EOS is not sampled before the second frame."""


def qwen3_tts_pipeline(stream: bool = True, vocoder_chunks: tuple[int, ...] = CODE2WAV_CHUNK_SCHEDULE
                       ) -> PipelineConfig:
    """`stream`: the decoder decodes each chunk (`vocoder_chunks` frames, the last size repeating) while the
    talker runs (False: once the talker finished; the same chunks)."""
    from vllm_omni.models.qwen3_omni.vllm_talker import talker_engine_kwargs
    from vllm_omni.models.qwen3_tts.vllm_talker import talker_hf_overrides

    # As Qwen3-Omni's: the newest filed frame is kept back, so the first chunk is complete two tokens later.
    hand_offs = {"chunk_tokens": TALKER_CHUNK_TOKENS, "first_chunk_tokens": vocoder_chunks[0] + 2} if stream else {}
    to_decoder = EdgeStreamConfig(stream=stream, chunk_schedule=list(vocoder_chunks), **hand_offs)
    ar, generation = StageExecutionType.AR, StageExecutionType.GENERATION
    return PipelineConfig(name="qwen3_tts", stages=[
        PipelineStageConfig(stage_id=0, execution_type=ar, input_processor="qwen3_tts_text_to_talker",
                            output_collector="qwen3_tts_talker_frames",
                            engine_args={**talker_engine_kwargs(), "hf_overrides": talker_hf_overrides},
                            default_sampling_params=TALKER_DEFAULT_SAMPLING),
        PipelineStageConfig(stage_id=1, execution_type=generation, inputs=[0], stream_inputs={0: to_decoder},
                            input_processor="qwen3_tts_talker_to_decoder", final_output=True,
                            final_output_type="audio",
                            engine_args={"model_class": "vllm_omni.models.qwen3_tts.speech_decoder:"
                                                        "Qwen3TTSSpeechDecoder"}),
    ])


@functools.cache
def _checkpoint(model_path: str):
    """(config, token ids, tokenizer) of a checkpoint, read once per process."""
    from transformers import AutoTokenizer

    from vllm_omni.models.qwen3_tts.configuration import Qwen3TTSConfig

    config = Qwen3TTSConfig.from_pretrained(model_path)
    return config, Qwen3TTSTokenIds.from_config(config), AutoTokenizer.from_pretrained(Path(model_path))


def text_to_talker_request(upstream: list[StagePayload], original_prompt: Any,
                           context: StageInputContext) -> StageInput:
    """The entry stage's input: the talker's placeholder prompt and params carrying its conditioning.

    Of the caller's talker `SamplingParams`: `max_tokens` (codec frames) and `temperature` / `top_k` / `top_p` /
    `repetition_penalty` / `seed` (temperature 0 = greedy, the code predictor too)."""
    from vllm_omni.models.qwen3_omni.vllm_talker import codec_talker_request

    config, ids, tokenizer = _checkpoint(context.stage.model)
    request = original_prompt if isinstance(original_prompt, dict) else {"prompt": original_prompt}
    text = request.get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise OmniClientError("the text to speak must be a non-empty string", param="input")
    speaker = _speaker(config, ids, request.get("voice"))
    instruction = request.get("instructions") or None
    if instruction is not None and not _takes_instructions(config):
        raise OmniClientError(f"this Qwen3-TTS checkpoint ({config.tts_model_type}, {config.tts_model_size}) "
                              "takes no instructions (voice design: a VoiceDesign checkpoint; style: a 1.7B "
                              "CustomVoice one)", param="instructions")
    instruction_ids = tokenizer(instruction_text(instruction))["input_ids"] if instruction else None
    try:
        prompt = talker_prompt(tokenizer(speech_text(text))["input_ids"], ids, speaker=speaker,
                               language=str(request.get("language") or "auto"), instruction_ids=instruction_ids)
    except ValueError as e:
        param = "language" if "language" in str(e) else "input"
        raise OmniClientError(str(e), param=param) from e
    sampling = talker_sampling(context.sampling_params)
    talker = config.talker_config
    max_len = context.stage.engine_args.get("max_model_len") or talker.max_position_embeddings
    if len(prompt.thinker_ids) >= max_len:
        raise OmniClientError(f"the text is too long for the talker ({len(prompt.thinker_ids)} prompt positions, "
                              f"at most {max_len - 1})", param="input")
    vllm_prompt, params = codec_talker_request(
        prompt, context.request_id, vocab_size=talker.vocab_size, codec_eos=talker.codec_eos_token_id,
        max_new_tokens=min(sampling.max_new_tokens, max_len - len(prompt.thinker_ids)), sampling=sampling,
        code_sampling=CODE_PREDICTOR_SAMPLING, min_tokens=MIN_FRAMES)
    return StageInput(vllm_prompt, params)


def _speaker(config, ids: Qwen3TTSTokenIds, voice: Any) -> str | None:
    """The request's speaker: a CustomVoice checkpoint's named one (its first for no voice or an OpenAI voice
    name); the other checkpoints have none, and a voice other than OpenAI's is refused."""
    if isinstance(voice, dict):
        raise OmniClientError("voice cloning from reference audio is not supported yet", param="voice")
    speaker = resolve_voice(voice, ids.speakers)
    if config.tts_model_type != "custom_voice":
        if speaker is not None:
            raise OmniClientError(f"this Qwen3-TTS checkpoint ({config.tts_model_type}) has no named voices; "
                                  "describe the voice in `instructions`", param="voice")
        if config.tts_model_type == "base":
            raise OmniClientError("Qwen3-TTS Base checkpoints clone a reference voice, which is not supported yet",
                                  param="voice")
        return None
    return speaker or next(iter(ids.speakers))


def _takes_instructions(config) -> bool:
    return config.tts_model_type == "voice_design" or (config.tts_model_type == "custom_voice"
                                                        and config.tts_model_size != "0b6")
