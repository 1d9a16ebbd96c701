"""GENERATION stage type on a real non-autoregressive model: the tiny Qwen3-Omni Code2Wav vocoder.

Pins: a one-stage generation pipeline declared in YAML runs through AsyncOmni; concurrent requests are
co-batched into one forward, run with the stage's `torch_num_threads`; each request's audio equals the vocoder
called directly on its chunks; an empty input is a client error naming `prompt`.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from vllm_omni import AsyncOmni
from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.errors import OmniClientError

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]
CODE2WAV = "vllm_omni.models.qwen3_omni.code2wav:Qwen3OmniCode2Wav"


@pytest.fixture(scope="module")
def model_dir():
    return build_tiny("qwen3-omni")


@pytest.fixture(scope="module")
def omni(model_dir, tmp_path_factory):
    pipeline = tmp_path_factory.mktemp("pipeline") / "code2wav.yaml"
    pipeline.write_text("name: code2wav\nstages:\n  - stage_id: 0\n    execution_type: generation\n"
                        f"    engine_args: {{model_class: '{CODE2WAV}', torch_num_threads: 1}}\n"
                        "    final_output: true\n")
    engine = AsyncOmni(str(model_dir), pipeline_config=str(pipeline))
    yield engine
    engine.close()


def chunks_for(model_dir, seed: int, num_frames: int):
    from transformers import AutoConfig

    from vllm_omni.models.qwen3_omni.stage_input_processors import talker_to_code2wav

    cfg = AutoConfig.from_pretrained(model_dir).code2wav_config
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, cfg.codebook_size, size=(num_frames, cfg.num_quantizers)).tolist()
    return talker_to_code2wav(frames, chunk_size=8, left_context=2)


async def collect(omni, prompt, request_id):
    return [o async for o in omni.generate(prompt, request_id)]


async def test_concurrent_requests_match_direct_vocoder(omni, model_dir):
    from vllm_omni.models.qwen3_omni.code2wav import Qwen3OmniCode2Wav

    assert omni.stage_types == ["generation"] and omni.output_modalities == {"audio"}
    inputs = {f"wav-{i}": chunks_for(model_dir, i, 12 + 5 * i) for i in range(3)}
    calls = []
    stage = omni.engine.stage_clients[0]
    forward = stage.model.forward
    stage.model.forward = lambda items: calls.append((len(items), torch.get_num_threads())) or forward(items)
    try:
        results = await asyncio.gather(*(collect(omni, chunks, rid) for rid, chunks in inputs.items()))
    finally:
        stage.model.forward = forward
    assert sum(n for n, _ in calls) == sum(len(c) for c in inputs.values()) and len(calls) < len(inputs)  # co-batched
    assert {threads for _, threads in calls} == {1}  # torch_num_threads, on the thread that runs the model
    vocoder = Qwen3OmniCode2Wav.from_pretrained(model_dir)
    for chunks, (out,) in zip(inputs.values(), results, strict=True):
        assert out.finished and out.final_output_type == "audio" and out.multimodal_output["sample_rate"] == 24000
        expected = np.concatenate(vocoder(chunks))
        # co-batched rows vs one request alone: float32 batching noise only
        np.testing.assert_allclose(out.multimodal_output["audio"], expected, rtol=1e-4, atol=1e-4)
        assert "generation" in out.stage_durations


async def test_empty_input_is_client_error(omni):
    with pytest.raises(OmniClientError) as info:
        [o async for o in omni.generate([], "empty")]
    assert info.value.param == "prompt"
