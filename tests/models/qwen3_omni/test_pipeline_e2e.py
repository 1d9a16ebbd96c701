"""Qwen3-Omni end to end on CPU: vLLM thinker -> vLLM talker (ours) -> Code2Wav, against transformers' generate.

What it pins (issue #4's acceptance, on the tiny checkpoint, greedy): the text tokens of vLLM's own
`Qwen3OmniMoeThinkerForConditionalGeneration`, the codec frames of our talker running on vLLM's EngineCore
(scheduler, paged KV cache, fused MoE; MTP code predictor inside the forward) and the waveform equal
transformers' reference `generate` on the same weights (tokens and frames exact; waveform allclose). Two requests
go through each engine in one batch, so per-request conditioning must not leak between rows. The stages are
chained through the same stage-input processors the multi-stage engine uses, in the test (test_omni_e2e.py runs
the same comparison through the control plane). The talker engine is the package's `Omni` talker stage's
(same `talker_engine_kwargs`), driven directly through its vLLM `AsyncLLM`, not through the stage client.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.models.qwen3_omni.code2wav import Qwen3OmniCode2Wav
from vllm_omni.models.qwen3_omni.stage_input_processors import (
    Qwen3OmniTokenIds,
    talker_to_code2wav,
    thinker_to_talker,
)
from vllm_omni.models.qwen3_omni.vllm_talker import talker_request

from .conftest import chat_prompt_ids, hf_generate

THINKER_TOKENS = 8
TALKER_TOKENS = 10
PROMPTS = ["Hello! How are you today?", "Describe the image in detail, then answer the question."]
ENGINE = dict(dtype="float32", gpu_memory_utilization=0.15, max_model_len=512, enforce_eager=True, seed=0)
TALKER_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def thinker_llm(tiny_path):
    from vllm import LLM

    llm = LLM(model=str(tiny_path), limit_mm_per_prompt={"image": 0, "video": 0, "audio": 0}, **ENGINE)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def talker_generate(omni, requests: list[tuple], keys: list[str]) -> tuple[list, dict[str, list]]:
    """Final outputs and collected frames of `requests` on the Omni talker stage's AsyncLLM, in one batch: its
    scheduler is paused ("keep") while both are added, so the first step after the resume schedules both."""
    talker = omni.engine.stage_clients[1].llm

    async def run():
        await talker.pause_generation(mode="keep", clear_cache=False)
        try:
            collectors = [await talker.add_request(key, prompt, params)
                          for (prompt, params), key in zip(requests, keys, strict=True)]
        finally:
            await talker.resume_generation()
        finals = []
        for collector in collectors:
            out = await collector.get()
            while not out.finished:
                out = await collector.get()
            finals.append(out)
        (frames,) = await talker.collective_rpc("take_talker_frames", args=(keys,))
        return finals, frames

    return omni.run_in_loop(run()).result(timeout=TALKER_TIMEOUT_S)


@pytest.mark.slow
def test_three_stages_equal_transformers_generate(thinker_llm, omni, hf_model, tiny_path) -> None:
    from vllm import SamplingParams

    prompt_ids = [chat_prompt_ids(tiny_path, text)[0].tolist() for text in PROMPTS]
    thinker_params = SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS, ignore_eos=True)
    thinker_out = [list(o.outputs[0].token_ids) for o in thinker_llm.generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids], thinker_params, use_tqdm=False)]

    token_ids = Qwen3OmniTokenIds.from_config(hf_model.config)
    keys = [f"req-{i}" for i in range(len(PROMPTS))]
    requests = [talker_request(thinker_to_talker(ids, out, token_ids), key, hf_model.config.talker_config,
                               max_new_tokens=TALKER_TOKENS)
                for ids, out, key in zip(prompt_ids, thinker_out, keys, strict=True)]
    talker_out, frames_by_key = talker_generate(omni, requests, keys)

    code2wav = Qwen3OmniCode2Wav.from_pretrained(tiny_path)
    for i, (ids, text_tokens) in enumerate(zip(prompt_ids, thinker_out, strict=True)):
        ref_tokens, ref_frames, ref_wav = hf_generate(hf_model, torch.tensor([ids]), THINKER_TOKENS, TALKER_TOKENS)
        assert text_tokens == ref_tokens

        frames = frames_by_key[keys[i]]
        assert frames == ref_frames
        assert [f[0] for f in frames] == list(talker_out[i].outputs[0].token_ids)[:len(frames)]

        wav = np.concatenate(code2wav(talker_to_code2wav(frames)))
        np.testing.assert_allclose(wav, ref_wav, rtol=1e-5, atol=1e-5)
        assert wav.std() > 1e-3
