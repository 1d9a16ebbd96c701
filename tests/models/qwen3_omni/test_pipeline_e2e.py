"""Qwen3-Omni end to end on CPU: vLLM's own thinker -> our talker -> our Code2Wav, against transformers' generate.

What it pins (issue #4's acceptance, on the tiny checkpoint, greedy): the text tokens of vLLM's
`Qwen3OmniMoeThinkerForConditionalGeneration`, the talker's codec frames and the waveform equal transformers'
reference `generate` on the same weights (tokens exact; waveform allclose). The stages are chained through the
same stage-input processors the multi-stage engine uses, in-process (the control plane has no GENERATION stage
or talker hidden-state plumbing yet).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.model_executor.models.qwen3_omni.code2wav import Qwen3OmniCode2Wav
from vllm_omni.model_executor.models.qwen3_omni.stage_input_processors import (
    Qwen3OmniTokenIds,
    talker_to_code2wav,
    thinker_to_talker,
)
from vllm_omni.model_executor.models.qwen3_omni.talker import Qwen3OmniTalker, TalkerSamplingParams

from .conftest import chat_prompt_ids

THINKER_TOKENS = 8
TALKER_TOKENS = 10
PROMPTS = ["Hello! How are you today?", "Describe the image in detail, then answer the question."]


@pytest.fixture(scope="module")
def thinker_llm(tiny_path):
    from vllm import LLM

    llm = LLM(model=str(tiny_path), dtype="float32", gpu_memory_utilization=0.15, max_model_len=512,
              enforce_eager=True, seed=0, limit_mm_per_prompt={"image": 0, "video": 0, "audio": 0})
    yield llm
    del llm


def _vllm_thinker(llm, prompt_ids: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _hf_generate(hf_model, ids: torch.Tensor):
    seen = {}
    chunked_decode = hf_model.code2wav.chunked_decode

    def record_codes(codes, **kwargs):
        seen["frames"] = codes[0].T.tolist()
        return chunked_decode(codes, **kwargs)

    hf_model.code2wav.chunked_decode = record_codes
    try:
        sequences, wav = hf_model.generate(
            ids, thinker_max_new_tokens=THINKER_TOKENS, thinker_do_sample=False, thinker_eos_token_id=None,
            talker_do_sample=False, talker_max_new_tokens=TALKER_TOKENS, talker_repetition_penalty=1.0,
            return_audio=True)
    finally:
        del hf_model.code2wav.chunked_decode
    return sequences[0, ids.shape[1]:].tolist(), seen["frames"], wav[0, 0].numpy()


@pytest.mark.slow
def test_three_stages_equal_transformers_generate(thinker_llm, hf_model, tiny_path) -> None:
    prompt_ids = [chat_prompt_ids(tiny_path, text) for text in PROMPTS]
    thinker_out = _vllm_thinker(thinker_llm, [ids[0].tolist() for ids in prompt_ids])  # one batch in vLLM
    token_ids = Qwen3OmniTokenIds.from_config(hf_model.config)
    talker = Qwen3OmniTalker.from_pretrained(tiny_path)
    code2wav = Qwen3OmniCode2Wav.from_pretrained(tiny_path)
    for ids, text_tokens in zip(prompt_ids, thinker_out, strict=True):
        ref_tokens, ref_frames, ref_wav = _hf_generate(hf_model, ids)
        assert text_tokens == ref_tokens

        talker_prompt = thinker_to_talker(ids[0].tolist(), text_tokens, token_ids)
        frames = talker.generate(talker_prompt, TalkerSamplingParams(max_new_tokens=TALKER_TOKENS)).frames
        assert frames == ref_frames

        wav = np.concatenate(code2wav(talker_to_code2wav(frames)))
        np.testing.assert_allclose(wav, ref_wav, rtol=1e-5, atol=1e-5)
        assert wav.std() > 1e-3
