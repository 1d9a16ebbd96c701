"""Qwen3-TTS without an engine: the tiny checkpoint's layout, the speech decoder against the `qwen-tts`
reference's decoder on the same codes, and the talker prompt's refusals (each names its request field)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_omni.errors import OmniClientError
from vllm_omni.models.qwen3_omni.stage_input_processors import NO_CODEC, CodecChunk
from vllm_omni.models.qwen3_tts.configuration import Qwen3TTSConfig
from vllm_omni.models.qwen3_tts.pipeline import text_to_talker_request
from vllm_omni.models.qwen3_tts.prompt import Qwen3TTSTokenIds, talker_prompt


def test_layout(tiny_path):
    """The files of Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice, and a config the reference's keys describe."""
    names = {p.relative_to(tiny_path).as_posix() for p in tiny_path.rglob("*") if p.is_file()}
    assert {"config.json", "generation_config.json", "model.safetensors", "vocab.json", "merges.txt",
            "tokenizer_config.json", "speech_tokenizer/config.json", "speech_tokenizer/model.safetensors",
            "speech_tokenizer/preprocessor_config.json"} <= names
    raw = json.loads((tiny_path / "config.json").read_text())
    assert raw["model_type"] == "qwen3_tts" and raw["tts_model_type"] == "custom_voice"
    assert "rope_scaling" in raw["talker_config"] and "code_predictor_config" in raw["talker_config"]
    config = Qwen3TTSConfig.from_pretrained(tiny_path)
    assert config.talker_config.code_predictor_config.num_code_groups == config.talker_config.num_code_groups


def test_speech_decoder_equals_reference(tiny_path, reference):
    """The whole utterance as one chunk equals the reference's `speech_tokenizer.decode` (one 300-frame chunk)."""
    from vllm_omni.models.qwen3_tts.speech_decoder import Qwen3TTSSpeechDecoder

    decoder = Qwen3TTSSpeechDecoder.from_pretrained(tiny_path)
    for ref in reference:
        codes = [list(group) for group in zip(*ref["frames"], strict=True)]
        (wav,) = decoder([CodecChunk(codes=codes, context=0, index=0, last=True)])
        assert wav.shape == ref["wav"].shape and float(np.abs(ref["wav"]).std()) > 1e-2
        np.testing.assert_allclose(wav, ref["wav"], rtol=0, atol=1e-4)


def test_prompt_preamble(tiny_path):
    """Speaker, language and dialect land in the codec preamble; a voice-design prompt has no speaker."""
    config = Qwen3TTSConfig.from_pretrained(tiny_path)
    ids, talker = Qwen3TTSTokenIds.from_config(config), config.talker_config
    text = list(range(100, 112))
    named = talker_prompt(text, ids, speaker="ryan", language="english")
    assert named.codec_ids[3:] == [talker.codec_think_id, talker.codec_think_bos_id,
                                   talker.codec_language_id["english"], talker.codec_think_eos_id,
                                   talker.spk_id["ryan"], talker.codec_pad_id, talker.codec_bos_id]
    dialect = talker_prompt(text, ids, speaker="dylan")  # "auto" -> the speaker's dialect
    assert talker.codec_language_id["beijing_dialect"] in dialect.codec_ids
    designed = talker_prompt(text, ids, instruction_ids=[7, 8])
    assert designed.thinker_ids[:5] == [7, 8, *text[:3]] and designed.codec_ids[:5] == [NO_CODEC] * 5
    assert designed.codec_ids[5:] == [talker.codec_nothink_id, talker.codec_think_bos_id, talker.codec_think_eos_id,
                                      talker.codec_pad_id, talker.codec_bos_id]
    assert designed.trailing_thinker_ids == text[4:-5] + [ids.tts_eos]


@pytest.mark.parametrize(("prompt", "param"), [
    ({"prompt": "Hi there.", "language": "klingon"}, "language"),
    ({"prompt": "Hi there.", "voice": "nobody"}, "voice"),
    ({"prompt": "Hi there.", "voice": {"audio": "ref.wav"}}, "voice"),
    ({"prompt": "   "}, "input"),
])
def test_bad_requests_name_their_field(tiny_path, prompt, param):
    context = SimpleNamespace(request_id="r", stage=SimpleNamespace(model=str(tiny_path), engine_args={}),
                              sampling_params=None)
    with pytest.raises(OmniClientError) as err:
        text_to_talker_request([], prompt, context)
    assert err.value.param == param


def test_openai_voice_names_select_the_first_speaker(tiny_path):
    context = SimpleNamespace(request_id="r", stage=SimpleNamespace(model=str(tiny_path), engine_args={}),
                              sampling_params=None)
    config = Qwen3TTSConfig.from_pretrained(tiny_path)
    first = next(iter(config.talker_config.spk_id.values()))
    for voice in (None, "alloy"):
        result = text_to_talker_request([], {"prompt": "Hi there.", "voice": voice}, context)
        assert first in result.sampling_params.extra_args["qwen3_omni_talker"]["codec_ids"]


def _variant(tiny_path, tmp_path, **config):
    """The tiny checkpoint with config.json fields replaced (the rest linked)."""
    tmp_path.mkdir()
    for item in tiny_path.iterdir():
        (tmp_path / item.name).symlink_to(item)
    (tmp_path / "config.json").unlink()
    raw = json.loads((tiny_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **config}))
    return SimpleNamespace(request_id="r", stage=SimpleNamespace(model=str(tmp_path), engine_args={}),
                           sampling_params=None)


def test_instructions_only_where_the_checkpoint_takes_them(tiny_path, tmp_path):
    """A 0.6B CustomVoice checkpoint takes no instructions (the reference drops them): a 400 naming the field;
    a VoiceDesign checkpoint takes them, has no named voices (OpenAI's names: none) and refuses other names."""
    small = _variant(tiny_path, tmp_path / "small", tts_model_size="0b6")
    with pytest.raises(OmniClientError) as err:
        text_to_talker_request([], {"prompt": "Hi there.", "instructions": "Whisper."}, small)
    assert err.value.param == "instructions"
    design = _variant(tiny_path, tmp_path / "design", tts_model_type="voice_design")
    result = text_to_talker_request([], {"prompt": "Hi there.", "voice": "alloy", "instructions": "A calm voice."},
                                    design)
    spec = result.sampling_params.extra_args["qwen3_omni_talker"]
    speakers = json.loads((tiny_path / "config.json").read_text())["talker_config"]["spk_id"].values()
    plain = text_to_talker_request([], {"prompt": "Hi there."}, design).sampling_params.extra_args
    from transformers import AutoTokenizer

    instruction = AutoTokenizer.from_pretrained(tiny_path)("<|im_start|>user\nA calm voice.<|im_end|>\n")["input_ids"]
    assert not set(spec["codec_ids"]) & set(speakers)  # no speaker in the preamble
    assert spec["thinker_ids"] == instruction + plain["qwen3_omni_talker"]["thinker_ids"]  # the instruction first
    with pytest.raises(OmniClientError) as err:
        text_to_talker_request([], {"prompt": "Hi there.", "voice": "vivian"}, design)
    assert err.value.param == "voice"
