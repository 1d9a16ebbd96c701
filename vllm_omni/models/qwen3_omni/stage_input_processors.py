"""Qwen3-Omni stage edges: thinker -> talker (what the talker is conditioned on) and talker -> code2wav (chunks).

thinker -> talker: the talker never sees the thinker's text directly. It is prompted with (a) the user turns,
as the thinker's input embeddings (text) or its `accept_hidden_layer` hidden states (audio/image/video
placeholders), (b) the assistant header plus the first spoken token, padded with `<tts_pad>` and a codec preamble
(no-think, speaker, codec BOS), and (c) one "trailing" thinker token per decode step (the rest of the answer,
then `<tts_text_eod>`, then `<tts_pad>`). Everything except the multimodal hidden states is a thinker token id,
so the payload is a few integer lists; the talker stage embeds them with the thinker's embedding table.

talker -> code2wav: codec frames (one id per codebook) are cut into chunks with left context so the vocoder can
stream; a chunk's audio is its frames' samples only (the context's samples are dropped).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

NO_CODEC = -1
"""`TalkerPrompt.codec_ids` entry for positions that carry no codec embedding."""


@dataclass(frozen=True)
class Qwen3OmniTokenIds:
    """The special ids the edges need, read once from the checkpoint's config."""

    im_start: int
    user: int
    assistant: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    thinker_eos: tuple[int, ...]
    multimodal: tuple[int, ...]  # thinker audio / image / video placeholder ids
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    codec_pad: int
    codec_bos: int
    speakers: dict[str, int]

    @classmethod
    def from_config(cls, config, thinker_eos: tuple[int, ...] | None = None) -> Qwen3OmniTokenIds:
        thinker, talker = config.thinker_config, config.talker_config
        return cls(
            im_start=config.im_start_token_id, user=config.user_token_id, assistant=config.assistant_token_id,
            tts_pad=config.tts_pad_token_id, tts_bos=config.tts_bos_token_id, tts_eos=config.tts_eos_token_id,
            thinker_eos=thinker_eos if thinker_eos is not None else (config.im_end_token_id,),
            multimodal=(thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id),
            codec_nothink=talker.codec_nothink_id, codec_think_bos=talker.codec_think_bos_id,
            codec_think_eos=talker.codec_think_eos_id, codec_pad=talker.codec_pad_id, codec_bos=talker.codec_bos_id,
            speakers={k.lower(): v for k, v in (talker.speaker_id or {}).items()},
        )


class TalkerPrompt(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One talker request, built from one thinker request. Lists are aligned position by position."""

    thinker_ids: list[int]
    """Thinker token id per talker prompt position (embedded with the thinker's table, then text-projected)."""
    codec_ids: list[int]
    """Codec id added at each position (NO_CODEC = none): the assistant preamble."""
    multimodal_positions: list[int]
    """Prompt positions that take the thinker's hidden state instead (hidden_projection), in order."""
    multimodal_source_positions: list[int]
    """For each multimodal position, its index in the thinker sequence (rows of the exported hidden states)."""
    user_source_positions: list[int]
    """For each user-turn position (the prompt's first entries), its index in the thinker prompt."""
    trailing_thinker_ids: list[int]
    """Decode step k adds the projected embedding of entry k; past the end, `<tts_pad>`'s."""
    tts_pad_id: int


def thinker_to_talker(prompt_token_ids: list[int], output_token_ids: list[int], ids: Qwen3OmniTokenIds,
                      speaker: str = "ethan") -> TalkerPrompt:
    """Build the talker's prompt from one finished thinker request (prompt ids + generated ids)."""
    speaker_id = ids.speakers.get(speaker.lower())
    if speaker_id is None:
        raise ValueError(f"speaker {speaker!r} is not one of this model's speakers {sorted(ids.speakers)}")
    if len(output_token_ids) < 2:
        raise ValueError("the talker needs at least 2 thinker output tokens (one to speak, one to end)")
    sequence = list(prompt_token_ids) + list(output_token_ids)
    # The thinker has states for every token it consumed: the prompt and all generated tokens but the last.
    consumed = len(sequence) - 1
    starts = [i for i in range(len(prompt_token_ids) - 1)
              if prompt_token_ids[i] == ids.im_start and prompt_token_ids[i + 1] == ids.assistant]
    if not starts:
        raise ValueError("thinker prompt has no '<|im_start|>assistant' turn; apply the chat template with "
                         "add_generation_prompt=True")
    assistant_start = starts[-1]

    # (a) user turns: a token belongs to the turn opened by the latest <|im_start|> at or before it.
    user_positions = []
    last_start = 0
    for pos, token in enumerate(prompt_token_ids):
        if token == ids.im_start:
            last_start = pos
        role = prompt_token_ids[min(last_start + 1, len(prompt_token_ids) - 1)]
        if role == ids.user:
            user_positions.append(pos)
    thinker_ids = [prompt_token_ids[p] for p in user_positions]
    mm_positions = [i for i, p in enumerate(user_positions) if prompt_token_ids[p] in ids.multimodal]
    mm_sources = [user_positions[i] for i in mm_positions]

    # (b) assistant header + first spoken token, under the codec preamble.
    assistant = sequence[assistant_start:consumed]
    thinker_ids += assistant[:3] + [ids.tts_pad] * 4 + [ids.tts_bos] + assistant[3:4]
    preamble = [ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos, speaker_id, ids.codec_pad,
                ids.codec_bos]
    codec_ids = [NO_CODEC] * (len(thinker_ids) - len(preamble)) + preamble

    # (c) the rest of the answer, one token per step, then the end-of-text marker; anything the thinker
    # produced after its first EOS is padding.
    trailing = assistant[4:] + [ids.tts_eos]
    first_eos = next((i for i, t in enumerate(output_token_ids) if t in ids.thinker_eos), len(output_token_ids))
    trailing = [ids.tts_eos if j == first_eos else ids.tts_pad if j > first_eos else t
                for j, t in enumerate(trailing)]
    return TalkerPrompt(thinker_ids=thinker_ids, codec_ids=codec_ids, multimodal_positions=mm_positions,
                        multimodal_source_positions=mm_sources, user_source_positions=user_positions,
                        trailing_thinker_ids=trailing, tts_pad_id=ids.tts_pad)


def talker_mrope_positions(thinker_positions: list[list[int]], prompt: TalkerPrompt) -> tuple[list[list[int]], int]:
    """The talker prompt's M-RoPE positions (3, P) and decode delta, from the thinker prompt's (3, T).

    transformers runs `get_rope_index` over the talker's own sequence (the user turns, then the assistant part as
    text). Positions there only depend on earlier tokens through "previous maximum + 1", so each run of user
    tokens that is contiguous in the thinker prompt keeps the thinker's positions shifted to start where the talker
    sequence is; runs start with `<|im_start|>` (text, all three equal). Assumes the talker's
    `position_id_per_seconds` and `spatial_merge_size` equal the thinker's (they do in Qwen3-Omni's config)."""
    rows: list[list[int]] = [[], [], []]
    next_pos, previous, shift = 0, None, 0
    for src in prompt.user_source_positions:
        if previous is None or src != previous + 1:
            shift = next_pos - thinker_positions[0][src]
        for dim in range(3):
            rows[dim].append(thinker_positions[dim][src] + shift)
        next_pos = max(next_pos, max(r[-1] for r in rows) + 1)
        previous = src
    for _ in range(len(prompt.thinker_ids) - len(prompt.user_source_positions)):  # assistant part: text
        for dim in range(3):
            rows[dim].append(next_pos)
        next_pos += 1
    return rows, next_pos - len(prompt.thinker_ids)


class CodecChunk(msgspec.Struct, kw_only=True, array_like=True):
    """A slice of codec frames for the vocoder: `codes[g][t]` for codebook g, with `context` leading frames
    that only condition the chunk (their audio was already emitted with the previous chunk)."""

    codes: list[list[int]]
    context: int
    index: int
    last: bool


def talker_to_code2wav(frames: list[list[int]], *, chunk_size: int | Sequence[int] = 300, left_context: int = 25,
                       start_frame: int = 0, final: bool = True) -> list[CodecChunk]:
    """Cut frames[start_frame:] (each `[code_0, ..., code_{G-1}]`) into vocoder chunks.

    `chunk_size` is one size, or a schedule: chunk i has `chunk_size[i]` frames, the last size repeating (a small
    first chunk for early audio, larger ones after it for less context overhead). With one size and the defaults
    the concatenated chunk audio equals transformers' `Code2Wav.chunked_decode`. For streaming call it as frames
    arrive with `final=False` and the first frame not yet chunked (a chunk border); only full chunks are emitted
    until `final=True` flushes the rest.
    """
    schedule = [chunk_size] if isinstance(chunk_size, int) else list(chunk_size)
    if not schedule or min(schedule) <= 0 or left_context < 0:
        raise ValueError(f"chunk sizes must be > 0 and left_context >= 0, got {chunk_size}, {left_context}")
    index, start = _chunk_at(schedule, start_frame)
    chunks = []
    while start < len(frames):
        size = schedule[min(index, len(schedule) - 1)]
        if not final and len(frames) - start < size:
            break
        end = min(start + size, len(frames))
        context = left_context if start - left_context > 0 else start
        window = frames[start - context:end]
        chunks.append(CodecChunk(codes=[list(g) for g in zip(*window, strict=True)], context=context,
                                 index=index, last=final and end == len(frames)))
        index, start = index + 1, end
    return chunks


def _chunk_at(schedule: list[int], start_frame: int) -> tuple[int, int]:
    """(index, first frame) of the chunk that starts at `start_frame` under `schedule`."""
    index, start = 0, 0
    while start < start_frame:
        start += schedule[min(index, len(schedule) - 1)]
        index += 1
    if start != start_frame:
        raise ValueError(f"frame {start_frame} is not a chunk border of the schedule {schedule}")
    return index, start
