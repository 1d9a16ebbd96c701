"""The streamed talker -> code2wav edge's processor: fed the talker's frames as they grow, it hands on exactly the
vocoder chunks the store-and-forward call makes from all frames (so the waveforms are equal), never a frame twice,
and keeps the newest frame back so the final call always has a chunk to end the stream with."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_omni.catalog.edges import StageInputContext
from vllm_omni.config.pipeline_config import EdgeStreamConfig
from vllm_omni.connectors.base import StagePayload
from vllm_omni.models.qwen3_omni.pipeline import (
    CODE2WAV_CHUNK_SCHEDULE,
    CODE2WAV_LEFT_CONTEXT,
    talker_to_code2wav_chunks,
)
from vllm_omni.models.qwen3_omni.stage_input_processors import talker_to_code2wav


def payload(frames):
    return [StagePayload(metadata={"stage_data": {"codec_frames": frames}})]


@pytest.mark.parametrize("schedule", [[], [25], [1, 3, 7]], ids=["default", "constant", "growing"])
@pytest.mark.parametrize(("total", "every"), [(80, 5), (60, 1), (50, 25), (3, 2)])
def test_streamed_chunks_equal_store_and_forward(total, every, schedule):
    frames = [[t, t + 1, t + 2] for t in range(total)]
    edge = EdgeStreamConfig(chunk_tokens=every, chunk_schedule=schedule)
    context = StageInputContext(request_id="r", stage=SimpleNamespace(), sampling_params=None, edge=edge,
                                final=False)
    streamed = []
    for seen in range(every, total, every):  # the worker has filed all frames but the newest token's
        streamed += talker_to_code2wav_chunks(payload(frames[:seen - 1]), None, context) or []
    context.final = True
    last = talker_to_code2wav_chunks(payload(frames), None, context)
    assert last, "the final call always ends the stream with a chunk"
    streamed += last
    whole = talker_to_code2wav_chunks(payload(frames), None, StageInputContext(
        request_id="s", stage=SimpleNamespace(), sampling_params=None,
        edge=EdgeStreamConfig(stream=False, chunk_schedule=schedule)))
    assert streamed == whole == talker_to_code2wav(frames, chunk_size=schedule or CODE2WAV_CHUNK_SCHEDULE,
                                                   left_context=CODE2WAV_LEFT_CONTEXT)
    sizes = [len(c.codes[0]) - c.context for c in whole]
    expected = (schedule or list(CODE2WAV_CHUNK_SCHEDULE)) + [(schedule or CODE2WAV_CHUNK_SCHEDULE)[-1]] * total
    assert sizes[:-1] == expected[:len(sizes) - 1] and 0 < sizes[-1] <= expected[len(sizes) - 1]
    assert [c.index for c in whole] == list(range(len(whole)))
    assert [c.last for c in streamed] == [False] * (len(streamed) - 1) + [True]


def test_no_frames_at_the_end_is_an_error():
    context = StageInputContext(request_id="r", stage=SimpleNamespace(), sampling_params=None)
    with pytest.raises(RuntimeError, match="no codec frames"):
        talker_to_code2wav_chunks(payload([]), None, context)


def test_a_chunk_start_off_the_schedule_is_refused():
    with pytest.raises(ValueError, match="not a chunk border"):
        talker_to_code2wav([[0]] * 10, chunk_size=[4, 8], start_frame=5)
