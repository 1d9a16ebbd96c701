"""The waveform the pipeline must make from given codec frames, with transformers' vocoder."""

from __future__ import annotations

import numpy as np
import torch


def hf_vocoder_chunks(hf_model, frames: list[list[int]]) -> np.ndarray:
    """transformers' `Code2Wav` run on the pipeline's vocoder chunks of `frames` (its default schedule and left
    context), each chunk's own samples concatenated: what the pipeline returns, streamed or not. With one chunk
    size this is transformers' `chunked_decode`."""
    from vllm_omni.models.qwen3_omni.pipeline import CODE2WAV_CHUNK_SCHEDULE, CODE2WAV_LEFT_CONTEXT
    from vllm_omni.models.qwen3_omni.stage_input_processors import talker_to_code2wav

    chunks = talker_to_code2wav(frames, chunk_size=CODE2WAV_CHUNK_SCHEDULE, left_context=CODE2WAV_LEFT_CONTEXT)
    step = hf_model.code2wav.total_upsample
    with torch.inference_mode():
        return np.concatenate([hf_model.code2wav(torch.tensor(c.codes)[None])[0, 0].numpy()[c.context * step:]
                               for c in chunks])
