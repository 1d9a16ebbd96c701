"""The talker stage's vLLM view of the checkpoint (`hf_overrides`) and its request encoding, without an engine.

Why it matters: vLLM sizes the KV cache, vocabulary and max length from `hf_text_config`; if the override left
the thinker's config in place the talker would load with the wrong shapes. vLLM also calls the hook with a
placeholder config to probe `model_type`, which must pass through untouched.
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig, PretrainedConfig

from vllm_omni.catalog.registry import MODEL_REGISTRY
from vllm_omni.models.qwen3_omni.stage_input_processors import Qwen3OmniTokenIds, thinker_to_talker
from vllm_omni.models.qwen3_omni.vllm_talker import (
    ARCHITECTURE,
    EXTRA_ARGS_KEY,
    talker_hf_overrides,
    talker_request,
)


def test_overrides_hand_vllm_the_talker_config(tiny_path) -> None:
    config = AutoConfig.from_pretrained(tiny_path)
    talker = talker_hf_overrides(config)
    assert talker.architectures == [ARCHITECTURE] and ARCHITECTURE in MODEL_REGISTRY.ar_models()
    assert talker.get_text_config() is talker.text_config
    assert talker.text_config.vocab_size == config.talker_config.text_config.vocab_size
    assert talker.thinker_vocab_size == config.thinker_config.text_config.vocab_size
    assert "mrope_section" not in talker.text_config.rope_parameters
    assert "mrope_section" in config.talker_config.text_config.rope_parameters  # the original is untouched
    probe = PretrainedConfig(architectures=[""], model_type="dummy_x")
    assert talker_hf_overrides(probe) is probe


def test_request_carries_conditioning_and_codec_vocabulary(tiny_path) -> None:
    config = AutoConfig.from_pretrained(tiny_path)
    ids = Qwen3OmniTokenIds.from_config(config)
    prompt = thinker_to_talker([ids.im_start, ids.user, 5, 6, ids.im_start, ids.assistant, 7], [9, 10, 11],
                               ids)
    vllm_prompt, params = talker_request(prompt, "k", config.talker_config, max_new_tokens=5)
    assert len(vllm_prompt["prompt_token_ids"]) == len(prompt.thinker_ids)
    spec = params.extra_args[EXTRA_ARGS_KEY]
    assert spec["key"] == "k" and spec["trailing_thinker_ids"] == prompt.trailing_thinker_ids
    eos = config.talker_config.codec_eos_token_id
    assert params.stop_token_ids == [eos] and eos in params.allowed_token_ids
    assert config.talker_config.codec_pad_id not in params.allowed_token_ids


def test_multimodal_prompt_needs_the_thinker_hidden_states(tiny_path) -> None:
    config = AutoConfig.from_pretrained(tiny_path)
    ids = Qwen3OmniTokenIds.from_config(config)
    audio = ids.multimodal[0]
    prompt = thinker_to_talker([ids.im_start, ids.user, audio, ids.im_start, ids.assistant, 7], [9, 10], ids)
    assert prompt.multimodal_positions == [2] and prompt.multimodal_source_positions == [2]
    with pytest.raises(ValueError, match="multimodal positions"):
        talker_request(prompt, "k", config.talker_config)


@pytest.mark.parametrize("use_audio_in_video", [False, True], ids=["audio+image", "video+audio_in_video"])
def test_talker_mrope_positions_equal_transformers(hf_model, tiny_path, monkeypatch, use_audio_in_video) -> None:
    """The talker's M-RoPE positions derived from the thinker's equal transformers' `get_rope_index` over the
    talker's own sequence (user turn, then the assistant part as text), and so does the decode delta."""
    import torch

    from vllm_omni.models.qwen3_omni.processing import qwen3_omni_processor
    from vllm_omni.models.qwen3_omni.stage_input_processors import talker_mrope_positions

    from .conftest import media_inputs, media_prompt

    audio, image, video = media_inputs()
    if use_audio_in_video:
        prompt, media = media_prompt(tiny_path, ["video"], "What?"), {"videos": [video], "audio": [audio]}
    else:
        prompt, media = media_prompt(tiny_path, ["audio", "image"], "What?"), {"audio": [audio], "images": [image]}
    inputs = qwen3_omni_processor(str(tiny_path))(text=prompt, return_tensors="pt",
                                                  use_audio_in_video=use_audio_in_video, **media)
    grids = (inputs.get("image_grid_thw"), inputs.get("video_grid_thw"))
    seconds, lengths = inputs.get("video_second_per_grid"), inputs["feature_attention_mask"].sum(1)
    ids = inputs["input_ids"]
    thinker_positions, _ = hf_model.thinker.get_rope_index(ids, *grids, torch.ones_like(ids), use_audio_in_video,
                                                           lengths, seconds)
    token_ids = Qwen3OmniTokenIds.from_config(hf_model.config)
    talker_prompt = thinker_to_talker(ids[0].tolist(), [9, 10, 11], token_ids)
    ours, delta = talker_mrope_positions(thinker_positions[:, 0].long().tolist(), talker_prompt)

    talker_ids = [ids[0, p].item() for p in talker_prompt.user_source_positions]
    talker_ids += [token_ids.tts_pad] * (len(talker_prompt.thinker_ids) - len(talker_ids))
    monkeypatch.setattr(hf_model.talker.config, "audio_config", hf_model.config.thinker_config.audio_config,
                        raising=False)  # transformers' talker reads the audio encoder's n_window from its own config
    talker_ids = torch.tensor([talker_ids])
    ref, ref_delta = hf_model.talker.get_rope_index(talker_ids, *grids, torch.ones_like(talker_ids),
                                                    use_audio_in_video, lengths, seconds)
    assert ours == ref[:, 0].long().tolist() and delta == int(ref_delta)
