"""Chat media checks (entrypoints/openai/chat_media.py) before and after vLLM decodes: each refusal names the
field, and speech for media input is refused only when asked for explicitly."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from PIL import Image

from vllm_omni.entrypoints.openai.chat_media import (
    MediaLimits,
    check_decoded_media,
    check_media_parts,
)
from vllm_omni.errors import OmniClientError

LIMITS = MediaLimits(max_audio_seconds=2.0, max_image_pixels=64 * 64, max_video_frames=4, max_upload_bytes=2**20)
ALL = frozenset({"audio", "image", "video"})


def user(*parts: dict) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [*parts, {"type": "text",
                                                                                           "text": "hi"}]}]


def png(width: int, height: int) -> str:
    import io

    buf = io.BytesIO()
    Image.new("RGB", (width, height)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def audio_part(fmt: str = "wav", data: str = base64.b64encode(b"RIFF").decode()) -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def test_text_only_messages_have_no_media():
    assert not check_media_parts(user(), ALL, "m", LIMITS)
    assert check_media_parts(user(audio_part(), {"type": "image_url", "image_url": {"url": png(8, 8)}},
                                  {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}),
                             ALL, "m", LIMITS)


@pytest.mark.parametrize("part,accepted,param,needle", [
    ({"type": "file", "file": {}}, ALL, "messages[1].content[0]", "unsupported content part"),
    ({"type": "image_url", "image_url": {"url": png(8, 8)}}, frozenset({"audio"}), "messages[1].content[0]",
     "does not take image"),
    ({"type": "audio_url", "audio_url": {}}, ALL, "messages[1].content[0].audio_url", "needs audio_url.url"),
    (audio_part("flac"), ALL, "messages[1].content[0].input_audio.format", "wav"),
    (audio_part(data=""), ALL, "messages[1].content[0].input_audio", "base64"),
    (audio_part(data="@@@@"), ALL, "messages[1].content[0].input_audio.data", "not valid base64"),
    ({"type": "image_url", "image_url": {"url": png(65, 64)}}, ALL, "messages[1].content[0].image_url",
     "pixels"),
])
def test_refused_parts_name_the_field(part, accepted, param, needle):
    with pytest.raises(OmniClientError, match=needle) as info:
        check_media_parts(user(part), accepted, "m", LIMITS)
    assert info.value.param == param and info.value.status_code == 400


@pytest.mark.parametrize("mm_data,needle", [
    ({"audio": [(np.zeros(16000 * 3), 16000)]}, "--max-input-audio-seconds"),
    ({"image": Image.new("RGB", (65, 64))}, "--max-input-image-pixels"),
    ({"video": [np.zeros((5, 8, 8, 3), np.uint8)]}, "--max-input-video-frames"),
    ({"video": [(np.zeros((2, 65, 64, 3), np.uint8), {"fps": 1})]}, "--max-input-image-pixels"),
])
def test_decoded_media_over_a_bound(mm_data, needle):
    with pytest.raises(OmniClientError, match=needle):
        check_decoded_media(mm_data, LIMITS)


def test_decoded_media_bounds_are_inclusive():
    """Media exactly at each bound passes (the call returns, nothing raised); one more second, pixel row or frame
    than the bound is refused, naming the flag."""
    at_bound = {"audio": [(np.zeros(32000), 16000)], "image": [Image.new("RGB", (64, 64))],
                "video": [np.zeros((4, 64, 64, 3), np.uint8)]}
    assert check_decoded_media(at_bound, LIMITS) is None
    for key, over, needle in (("audio", (np.zeros(32001), 16000), "--max-input-audio-seconds"),
                              ("image", Image.new("RGB", (64, 65)), "--max-input-image-pixels"),
                              ("video", np.zeros((5, 64, 64, 3), np.uint8), "--max-input-video-frames")):
        with pytest.raises(OmniClientError, match=needle):
            check_decoded_media({**at_bound, key: [over]}, LIMITS)


