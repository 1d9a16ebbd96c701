"""The Qwen3-TTS talker prompt: text ids and codec ids per position, as Qwen3-Omni's `TalkerPrompt`.

The text to speak is tokenized as `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n` (an
optional voice-design / style instruction as a user turn `<|im_start|>user\\n{instruction}<|im_end|>\\n` before
it). The prompt is the instruction and the role header as text only, then a codec preamble (think / no-think
tag, the language, the speaker, pad, BOS) under `<tts_pad>`s and `<tts_text_bos>`, ending with the first text
token. The rest of the text is read one token per decode step ("trailing"), then `<tts_text_eod>`, then
`<tts_pad>`: the talker speaks while the text is still being consumed (the reference's streaming-text layout,
`non_streaming_mode=False`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_omni.models.qwen3_omni.stage_input_processors import NO_CODEC, TalkerPrompt

TEXT_TAIL = 5
"""Tokens after the text: `<|im_end|>`, `\\n`, `<|im_start|>`, `assistant`, `\\n`."""


def speech_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruction_text(instruction: str) -> str:
    return f"<|im_start|>user\n{instruction}<|im_end|>\n"


@dataclass(frozen=True)
class Qwen3TTSTokenIds:
    """The special ids and names the prompt needs, read once from the checkpoint's config."""

    tts_pad: int
    tts_bos: int
    tts_eos: int
    codec_think: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    codec_pad: int
    codec_bos: int
    speakers: dict[str, int]
    speaker_dialects: dict[str, str | bool]
    languages: dict[str, int]

    @classmethod
    def from_config(cls, config) -> Qwen3TTSTokenIds:
        talker = config.talker_config
        return cls(tts_pad=config.tts_pad_token_id, tts_bos=config.tts_bos_token_id,
                   tts_eos=config.tts_eos_token_id, codec_think=talker.codec_think_id,
                   codec_nothink=talker.codec_nothink_id, codec_think_bos=talker.codec_think_bos_id,
                   codec_think_eos=talker.codec_think_eos_id, codec_pad=talker.codec_pad_id,
                   codec_bos=talker.codec_bos_id, speakers={k.lower(): v for k, v in talker.spk_id.items()},
                   speaker_dialects={k.lower(): v for k, v in talker.spk_is_dialect.items()},
                   languages={k.lower(): v for k, v in talker.codec_language_id.items()})


def talker_prompt(text_ids: list[int], ids: Qwen3TTSTokenIds, *, speaker: str | None = None,
                  language: str = "auto", instruction_ids: list[int] | None = None) -> TalkerPrompt:
    """`text_ids`: `speech_text(text)` tokenized; `speaker`: a speaker name of the checkpoint (None: none, the
    voice-design models); `language`: "auto" or one of the checkpoint's languages (ValueError otherwise)."""
    if len(text_ids) < 3 + 1 + TEXT_TAIL:
        raise ValueError("the text to speak is empty")
    language = language.lower()
    if language != "auto" and language not in ids.languages:
        raise ValueError(f"language {language!r} is not one of this model's languages "
                         f"{['auto', *sorted(ids.languages)]}")
    language_id = ids.languages.get(language)
    if speaker is not None:
        speaker = speaker.lower()
        if speaker not in ids.speakers:
            raise ValueError(f"speaker {speaker!r} is not one of this model's speakers {sorted(ids.speakers)}")
        dialect = ids.speaker_dialects.get(speaker)
        if language in ("chinese", "auto") and dialect:  # a dialect speaker speaks its dialect
            language_id = ids.languages[str(dialect).lower()]
    if language_id is None:
        preamble = [ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos]
    else:
        preamble = [ids.codec_think, ids.codec_think_bos, language_id, ids.codec_think_eos]
    if speaker is not None:
        preamble.append(ids.speakers[speaker])
    preamble += [ids.codec_pad, ids.codec_bos]

    head = list(instruction_ids or []) + text_ids[:3]
    # The preamble's positions carry <tts_pad>, then <tts_text_bos>, then the first text token.
    preamble_text = [ids.tts_pad] * (len(preamble) - 2) + [ids.tts_bos, text_ids[3]]
    return TalkerPrompt(
        thinker_ids=head + preamble_text, codec_ids=[NO_CODEC] * len(head) + preamble, multimodal_positions=[],
        multimodal_source_positions=[], user_source_positions=[],
        trailing_thinker_ids=text_ids[4:-TEXT_TAIL] + [ids.tts_eos], tts_pad_id=ids.tts_pad)
