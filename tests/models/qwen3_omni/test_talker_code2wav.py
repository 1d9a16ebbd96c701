"""Talker and Code2Wav stages against transformers' reference `generate` on the same tiny weights.

What it pins: from the thinker's prompt/output token ids alone, our thinker->talker edge rebuilds exactly the
talker prompt transformers builds; our talker (backbone + MTP code predictor loop) emits the same codec frames
(greedy, exact); and our chunked, batched Code2Wav reproduces transformers' waveform, also when chunks arrive
incrementally as in streaming.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.models.qwen3_omni.code2wav import Qwen3OmniCode2Wav
from vllm_omni.models.qwen3_omni.stage_input_processors import (
    CodecChunk,
    Qwen3OmniTokenIds,
    talker_to_code2wav,
    thinker_to_talker,
)
from vllm_omni.models.qwen3_omni.talker import Qwen3OmniTalker, TalkerSamplingParams

from .conftest import chat_prompt_ids

TALKER_TOKENS = 12


@pytest.fixture(scope="module")
def reference(hf_model, tiny_path):
    """transformers' generate, with the talker's inputs and the codec frames it hands to code2wav recorded."""
    seen = {}
    talker_generate, chunked_decode = hf_model.talker.generate, hf_model.code2wav.chunked_decode

    def record_talker(**kwargs):
        seen["talker_kwargs"] = kwargs
        return talker_generate(**kwargs)

    def record_codes(codes, **kwargs):
        seen["codes"] = codes.clone()
        return chunked_decode(codes, **kwargs)

    hf_model.talker.generate, hf_model.code2wav.chunked_decode = record_talker, record_codes
    try:
        ids = chat_prompt_ids(tiny_path, "Hello! How are you today?")
        sequences, wav = hf_model.generate(
            ids, thinker_max_new_tokens=8, thinker_do_sample=False, talker_do_sample=False,
            talker_max_new_tokens=TALKER_TOKENS, talker_repetition_penalty=1.0, return_audio=True)
    finally:
        del hf_model.talker.generate, hf_model.code2wav.chunked_decode
    return {"prompt_ids": ids[0].tolist(), "output_ids": sequences[0, ids.shape[1]:].tolist(),
            "frames": seen["codes"][0].T.tolist(), "wav": wav[0, 0].numpy(), **seen}


@pytest.fixture(scope="module")
def token_ids(hf_model) -> Qwen3OmniTokenIds:
    return Qwen3OmniTokenIds.from_config(hf_model.config)


@pytest.fixture(scope="module")
def talker(tiny_path) -> Qwen3OmniTalker:
    return Qwen3OmniTalker.from_pretrained(tiny_path)


@pytest.fixture(scope="module")
def code2wav(tiny_path) -> Qwen3OmniCode2Wav:
    return Qwen3OmniCode2Wav.from_pretrained(tiny_path)


def test_talker_prompt_matches_transformers(reference, token_ids, talker) -> None:
    prompt = thinker_to_talker(reference["prompt_ids"], reference["output_ids"], token_ids)
    kwargs = reference["talker_kwargs"]
    with torch.inference_mode():
        ours = talker.prompt_embeds(prompt)
        trailing = talker._project_text(prompt.trailing_thinker_ids)
    torch.testing.assert_close(ours, kwargs["inputs_embeds"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(trailing, kwargs["trailing_text_hidden"][0], rtol=1e-5, atol=1e-6)


def test_talker_codes_equal_transformers(reference, token_ids, talker) -> None:
    prompt = thinker_to_talker(reference["prompt_ids"], reference["output_ids"], token_ids)
    out = talker.generate(prompt, TalkerSamplingParams(max_new_tokens=TALKER_TOKENS))
    assert len(reference["frames"]) == TALKER_TOKENS - 1  # random weights never say codec EOS here
    assert out.frames == reference["frames"]
    assert out.finish_reason == "length" and out.stage_durations["talker"] > 0


def test_code2wav_equals_transformers(reference, code2wav) -> None:
    chunks = talker_to_code2wav(reference["frames"])
    wav = np.concatenate(code2wav(chunks))
    np.testing.assert_allclose(wav, reference["wav"], rtol=1e-5, atol=1e-6)
    assert code2wav.stage_durations["code2wav"] > 0


def test_streaming_chunks_batched_equal_transformers_chunked_decode(reference, hf_model, code2wav) -> None:
    frames = reference["frames"]
    chunks: list[CodecChunk] = []
    for arrived in range(1, len(frames) + 1):  # frames trickle in; only full chunks go out until the end
        done = sum(len(c.codes[0]) - c.context for c in chunks)
        chunks += talker_to_code2wav(frames[:arrived], chunk_size=3, left_context=2, start_frame=done,
                                     final=arrived == len(frames))
    assert [c.index for c in chunks] == list(range(len(chunks))) and chunks[-1].last
    wav = np.concatenate(code2wav(chunks))  # one call, each chunk decoded on its own
    with torch.inference_mode():
        ref = hf_model.code2wav.chunked_decode(torch.tensor(frames).T[None], chunk_size=3, left_context_size=2)
    # Batched convolutions round differently from one-by-one ones (~2e-5 here on samples of magnitude ~0.5).
    np.testing.assert_allclose(wav, ref[0, 0].numpy(), rtol=1e-4, atol=1e-4)


def test_scheduled_chunks_streamed_equal_whole_and_transformers(reference, hf_model, code2wav) -> None:
    """A growing chunk schedule (short first chunk): the chunks cut as frames trickle in decode to the same
    waveform as those cut once from all frames, and to transformers' vocoder on the same windows."""
    from vllm_omni.models.qwen3_omni.pipeline import CODE2WAV_LEFT_CONTEXT

    frames, schedule = reference["frames"], [2, 3, 4]
    streamed: list[CodecChunk] = []
    for arrived in range(1, len(frames) + 1):
        done = sum(len(c.codes[0]) - c.context for c in streamed)
        streamed += talker_to_code2wav(frames[:arrived], chunk_size=schedule, left_context=CODE2WAV_LEFT_CONTEXT,
                                       start_frame=done, final=arrived == len(frames))
    whole = talker_to_code2wav(frames, chunk_size=schedule, left_context=CODE2WAV_LEFT_CONTEXT)
    assert streamed == whole and [len(c.codes[0]) - c.context for c in whole][:3] == schedule
    wav = np.concatenate([code2wav([c])[0] for c in streamed])  # one vocoder call per chunk, as streamed
    np.testing.assert_allclose(wav, np.concatenate(code2wav(whole)), rtol=1e-5, atol=1e-5)
    step = hf_model.code2wav.total_upsample
    with torch.inference_mode():
        ref = np.concatenate([hf_model.code2wav(torch.tensor(c.codes)[None])[0, 0].numpy()[c.context * step:]
                              for c in whole])
    np.testing.assert_allclose(wav, ref, rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_field(reference, token_ids, code2wav) -> None:
    with pytest.raises(ValueError, match="speaker 'nobody'"):
        thinker_to_talker(reference["prompt_ids"], reference["output_ids"], token_ids, speaker="nobody")
    with pytest.raises(ValueError, match="assistant"):
        thinker_to_talker(reference["prompt_ids"][:-3], reference["output_ids"], token_ids)
    bad = CodecChunk(codes=[[0, 1]] * 4, context=0, index=0, last=True)
    bad.codes[1] = [0, 10**6]
    with pytest.raises(ValueError, match="codes must be in"):
        code2wav([bad])
