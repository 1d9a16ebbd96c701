"""Qwen3-TTS through the control plane: `Omni("tiny/qwen3-tts")` runs the talker (a vLLM EngineCore process, with
the code predictor in its forward) and the speech decoder (in process), the decoder's chunks streamed while the
talker runs. Greedy, the codec frames equal the `qwen-tts` package's `generate` on the same weights and the
waveform its decoder's on the pipeline's chunks; the requests go in one `generate` call, so they share the
talker's batch and per-request conditioning must not leak between its rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import FRAMES, REQUESTS, omni_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def omni():
    from vllm_omni import Omni

    engine = Omni("tiny/qwen3-tts", dtype="float32", gpu_memory_utilization=0.15, max_model_len=512,
                  enforce_eager=True, seed=0)
    yield engine
    engine.close()


@pytest.fixture
def talker_frames(omni, monkeypatch) -> dict[str, list]:
    """Codec frames of each finished talker request (by request id), seen on their way to the decoder."""
    talker = omni.engine.stage_clients[0]
    frames: dict[str, list] = {}
    collect = talker.generate

    async def spy(request_id, prompt, params):
        async for out in collect(request_id, prompt, params):
            if out.finished:
                frames[request_id] = out.multimodal_output["stage_data"]["codec_frames"]
            yield out

    monkeypatch.setattr(talker, "generate", spy)
    return frames


def test_layout(omni):
    assert omni.stage_types == ["llm", "generation"]
    assert omni.output_modalities == {"audio"}


def test_batched_frames_and_audio_equal_reference(omni, reference, talker_frames):
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=FRAMES), None]
    outputs = omni.generate([omni_prompt(r) for r in REQUESTS], params, use_tqdm=False)

    assert [(o.stage_id, o.final_output_type) for o in outputs] == [(1, "audio")] * len(REQUESTS)
    frames = [talker_frames[rid] for rid in sorted(talker_frames, key=lambda r: int(r.split("-")[0]))]
    for out, seen, ref in zip(outputs, frames, reference, strict=True):
        assert seen == ref["frames"] and len(seen) > 4
        assert out.finished and out.multimodal_output["sample_rate"] == 24000
        np.testing.assert_allclose(out.multimodal_output["audio"], ref["chunked"], rtol=0, atol=1e-4)
        assert {"stage-0-llm", "stage-1-generation", "e2e"} <= set(out.stage_durations)
