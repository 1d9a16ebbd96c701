"""Voice names of OpenAI's speech API, for models whose speakers have names of their own."""

from __future__ import annotations

from collections.abc import Collection

from vllm_omni.errors import OmniClientError

OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer",
                           "verse", "marin", "cedar"})
"""OpenAI's built-in voices. A model without a speaker of that name answers in its default voice, so clients
written for OpenAI (which always send a voice) work unchanged."""


def resolve_voice(voice: object, speakers: Collection[str]) -> str | None:
    """The model speaker `voice` names (case-insensitive), or None for the model's default voice (no voice, or
    one of OPENAI_VOICES the model lacks); any other name is a 400 naming `voice`."""
    if voice is None:
        return None
    name = str(voice).lower()
    if name in speakers:
        return name
    if name in OPENAI_VOICES:
        return None
    raise OmniClientError(f"voice {voice!r} is not one of this model's voices {sorted(speakers)} (OpenAI's voice "
                          "names select the model's default voice)", param="voice")
