"""Shared fixtures: the tiny checkpoint, transformers' reference model (loaded once per module), and one
`Omni("tiny/qwen3-omni")` for the package (test_omni_e2e.py drives it, test_pipeline_e2e.py uses its talker
engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_omni.catalog.tiny import build_tiny


def chat_prompt_ids(path: Path, user_text: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": user_text}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, return_tensors="pt").input_ids


def hf_generate(hf_model, ids: torch.Tensor, thinker_tokens: int, talker_tokens: int):
    """transformers' greedy reference: (text tokens, codec frames, waveform) of one prompt."""
    seen = {}
    chunked_decode = hf_model.code2wav.chunked_decode

    def record_codes(codes, **kwargs):
        seen["frames"] = codes[0].T.tolist()
        return chunked_decode(codes, **kwargs)

    hf_model.code2wav.chunked_decode = record_codes
    try:
        sequences, wav = hf_model.generate(
            ids, thinker_max_new_tokens=thinker_tokens, thinker_do_sample=False, thinker_eos_token_id=None,
            talker_do_sample=False, talker_max_new_tokens=talker_tokens, talker_repetition_penalty=1.0,
            return_audio=True)
    finally:
        del hf_model.code2wav.chunked_decode
    return sequences[0, ids.shape[1]:].tolist(), seen["frames"], wav[0, 0].numpy()


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    return build_tiny("qwen3-omni")


@pytest.fixture(scope="package")
def omni():
    """Thinker -> talker -> code2wav as three stages (two vLLM EngineCores and an in-process vocoder). One for the
    package: a start took ~45 s of CI, and test_pipeline_e2e.py needs the same talker engine."""
    from vllm_omni import Omni

    # skip_mm_profiling: the thinker's dummy multimodal profile (300 s of audio, a max-size video) costs ~20 s of
    # CPU at start-up and sizes nothing on CPU.
    engine = Omni("tiny/qwen3-omni", dtype="float32", gpu_memory_utilization=0.15, max_model_len=512,
                  enforce_eager=True, seed=0, skip_mm_profiling=True)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_model(tiny_path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.float32).eval()


def media_inputs(seed: int = 0):
    """A 1 s 16 kHz tone with noise, a 64x80 RGB image and 4 64x64 frames: small, deterministic, not constant."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    t = np.arange(16000) / 16000
    audio = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.randn(16000)).astype(np.float32)
    image = Image.fromarray((rng.rand(64, 80, 3) * 255).astype(np.uint8))
    video = (rng.rand(4, 64, 64, 3) * 255).astype(np.uint8)
    return audio, image, video


def media_prompt(path: Path, parts: list[str], text: str) -> str:
    """The chat template over one user turn with media parts (`"audio"`, `"image"`, `"video"`) then text."""
    from transformers import AutoTokenizer

    content = [{"type": p} for p in parts] + [{"type": "text", "text": text}]
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": content}]
    return AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=False)


def hf_thinker_tokens(hf_model, path: Path, prompt: str, tokens: int, use_audio_in_video: bool = False,
                      **media) -> list[int]:
    """transformers' greedy thinker tokens for a prompt with media, processed by the checkpoint's processor."""
    from vllm_omni.models.qwen3_omni.processing import qwen3_omni_processor

    processor = qwen3_omni_processor(str(path))
    inputs = processor(text=prompt, return_tensors="pt", use_audio_in_video=use_audio_in_video, **media)
    with torch.no_grad():
        sequences = hf_model.generate(**inputs, thinker_max_new_tokens=tokens, thinker_do_sample=False,
                                      thinker_eos_token_id=None, return_audio=False,
                                      use_audio_in_video=use_audio_in_video)
    return sequences[0, inputs["input_ids"].shape[1]:].tolist()
