"""A second topology through the same machinery: AR (tiny Qwen2) -> DIFFUSION (tiny Qwen-Image), declared in
YAML, payloads through the shared-memory connector.

Pins: the diffusion stage is conditioned on the AR stage's text (same result as feeding that text directly),
only the final stage streams out, per-stage durations, and the multi-stage sleep -> wake -> resume ->
generate cycle (AR sleep keeps admission closed until resume_generation).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from vllm import SamplingParams

from vllm_omni import AsyncOmni
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]
PIPELINE = Path(__file__).parents[2] / "examples/offline_inference/pipelines/prompt_rewriter_to_qwen_image.yaml"


@pytest.fixture(scope="module")
def omni():
    engine = AsyncOmni("tiny/qwen2", pipeline_config=str(PIPELINE), deploy_config="shm_connector",
                       dtype="float32", gpu_memory_utilization=0.15, enforce_eager=True,
                       stage_overrides={"0": {"max_num_seqs": 4}})
    yield engine
    engine.close()


def params(seed: int = 0) -> list:
    return [SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, ignore_eos=True),
            OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=2, seed=seed)]


async def run(omni, rid: str, prompt="a cat on a chair", sampling=None):
    return [out async for out in omni.generate(prompt, rid, sampling or params())]


async def test_layout(omni):
    assert omni.stage_types == ["llm", "diffusion"] and omni.output_modalities == {"image"}
    assert omni.config.connector_for(0, 1).name == "shm"


async def test_ar_text_conditions_the_image(omni, monkeypatch):
    diffusion_stage = omni.engine.stage_clients[1]
    seen: list = []
    original = diffusion_stage.add_request_async

    async def spy(request_id, prompt, sampling_params, **kwargs):
        seen.append(prompt)
        return await original(request_id, prompt, sampling_params, **kwargs)

    monkeypatch.setattr(diffusion_stage, "add_request_async", spy)
    (out,) = await run(omni, "two-stage")
    assert out.finished and out.stage_id == 1 and out.final_output_type == "image" and len(out.images) == 1
    assert {"llm", "diffusion", "diffusion.denoise", "e2e"} <= set(out.stage_durations)
    assert seen == [hf_greedy_text("a cat on a chair", 8)]  # stage 1 drew the AR stage's text
    (again,) = await run(omni, "again")
    assert np.array_equal(np.asarray(again.images[0]), np.asarray(out.images[0]))


def hf_greedy_text(prompt: str, n: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_omni.catalog.tiny import build_tiny

    path = build_tiny("qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(prompt, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, ids.shape[1]:]
    return tok.decode(gen, skip_special_tokens=True)


async def test_sleep_wake_resume_generate(omni):
    (before,) = await run(omni, "before-sleep")
    acks = await omni.sleep(level=1)
    assert sorted(a.stage_id for a in acks) == [0, 1]
    pending = asyncio.create_task(run(omni, "while-asleep"))
    await asyncio.sleep(0.5)
    assert not pending.done()
    await omni.wake_up()
    await asyncio.sleep(0.3)
    assert omni.is_paused() and not pending.done()  # AR sleep: admission waits for resume_generation
    await omni.resume_generation()
    (after,) = await asyncio.wait_for(pending, 60)
    assert np.array_equal(np.asarray(after.images[0]), np.asarray(before.images[0]))
