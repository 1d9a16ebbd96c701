"""Chat messages with media content parts for an AR stage 0 that takes media (Qwen3-Omni's thinker).

Parsing, fetching and decoding are vLLM's own (`parse_chat_messages_async` and its media connector: `data:` URLs
always; `file:` URLs under `--allowed-local-media-path`; http(s) URLs, restricted to `--allowed-media-domains`
when that is set). This module only checks what vLLM would skip or report without naming the field, and bounds
what was decoded (seconds of audio, pixels, frames) before anything is queued.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from vllm_omni.entrypoints.openai.media import data_url_bytes, probe_image
from vllm_omni.errors import OmniClientError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

MEDIA_PARTS = {"input_audio": "audio", "audio_url": "audio", "image_url": "image", "video_url": "video"}
"""Content part type -> the modality it gives the model."""
INPUT_AUDIO_FORMATS = ("wav", "mp3")


@dataclass(frozen=True)
class MediaLimits:
    """What one request's decoded media may hold (the server's `--max-input-*` flags)."""

    max_audio_seconds: float
    max_image_pixels: int
    max_video_frames: int
    max_upload_bytes: int

    @classmethod
    def from_server(cls, limits: Any) -> MediaLimits:
        """From the server's `ServerLimits`."""
        return cls(max_audio_seconds=limits.max_input_audio_seconds, max_image_pixels=limits.max_input_image_pixels,
                   max_video_frames=limits.max_input_video_frames, max_upload_bytes=limits.max_upload_bytes)


def media_parts(messages: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(param, part) of every media part, in order; parts are checked as they are listed."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part.get("type") != "text":
                found.append((f"messages[{i}].content[{j}]", part))
    return found


def check_media_parts(messages: list[dict[str, Any]], accepted: frozenset[str], model_name: str,
                      limits: MediaLimits) -> bool:
    """Refuse, naming the part, what vLLM would skip silently or could not attribute: unknown part types,
    modalities the model does not take, missing URLs / data, unsupported audio formats, oversized data: images.
    Returns whether there is any media part."""
    parts = media_parts(messages)
    for param, part in parts:
        kind = part.get("type")
        modality = MEDIA_PARTS.get(kind)
        if modality is None:
            raise OmniClientError(f"{param}: unsupported content part type {kind!r} (accepted: text, "
                                  f"{', '.join(MEDIA_PARTS)})", param=param)
        if modality not in accepted:
            raise OmniClientError(f"{param}: `{model_name}` does not take {modality} input (it takes "
                                  f"{sorted(accepted)})", param=param)
        if kind == "input_audio":
            _check_input_audio(part.get("input_audio"), f"{param}.input_audio", limits.max_upload_bytes)
            continue
        value = part.get(kind)
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise OmniClientError(f"{param}: a {kind} part needs {kind}.url", param=f"{param}.{kind}")
        if kind == "image_url" and url.startswith("data:"):  # header only: a small PNG may expand to gigabytes
            probe_image(data_url_bytes(url, f"{param}.{kind}", limits.max_upload_bytes), f"{param}.{kind}",
                        limits.max_image_pixels)
    return bool(parts)


def _check_input_audio(value: Any, param: str, max_upload_bytes: int) -> None:
    if not isinstance(value, dict) or not isinstance(value.get("data"), str) or not value["data"]:
        raise OmniClientError(f"{param} needs base64 `data` and a `format`", param=param)
    if value.get("format") not in INPUT_AUDIO_FORMATS:
        raise OmniClientError(f"{param}.format must be one of {list(INPUT_AUDIO_FORMATS)}, got "
                              f"{value.get('format')!r}", param=f"{param}.format")
    if len(value["data"]) * 3 // 4 > max_upload_bytes:
        raise OmniClientError(f"{param}.data is larger than the {max_upload_bytes // 2**20} MiB upload limit",
                              status_code=413, param=f"{param}.data")
    try:
        base64.b64decode(value["data"], validate=True)
    except binascii.Error as exc:
        raise OmniClientError(f"{param}.data is not valid base64: {exc}", param=f"{param}.data") from exc


async def parse_media_messages(messages: list[dict[str, Any]], model_config: Any,
                               mm_processor_kwargs: dict[str, Any] | None, limits: MediaLimits
                               ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(conversation for the chat template, multi_modal_data) through vLLM's parser and media connector."""
    from vllm.renderers.chat_utils import parse_chat_messages_async

    try:
        conversation, mm_data, _ = await parse_chat_messages_async(
            messages, model_config, content_format="openai", mm_processor_kwargs=mm_processor_kwargs)
    except Exception as exc:  # decoding user media: whatever the decoder raises is about the input
        logger.debug("media parsing failed", exc_info=True)
        raise OmniClientError(f"messages: media could not be read: {exc}",
                              param=getattr(exc, "parameter", None) or "messages") from exc
    if mm_data:
        check_decoded_media(mm_data, limits)
    return conversation, mm_data


def _items(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def check_decoded_media(mm_data: dict[str, Any], limits: MediaLimits) -> None:
    """Bound decoded media: seconds per audio item, pixels per image / video frame, frames per video."""
    for audio in _items(mm_data.get("audio", [])):
        samples, rate = audio if isinstance(audio, tuple) else (audio, None)
        seconds = len(samples) / rate if rate else 0.0
        if seconds > limits.max_audio_seconds:
            raise OmniClientError(f"an input audio is {seconds:.1f} s long, more than this server takes "
                                  f"({limits.max_audio_seconds} s; see --max-input-audio-seconds)", param="messages")
    for image in _items(mm_data.get("image", [])):
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise OmniClientError(f"an input image is {width}x{height} pixels, more than this server takes "
                                  f"({limits.max_image_pixels}; see --max-input-image-pixels)", param="messages")
    for video in _items(mm_data.get("video", [])):
        frames = video[0] if isinstance(video, tuple) else video
        count, height, width = len(frames), *frames.shape[1:3]
        if count > limits.max_video_frames or width * height > limits.max_image_pixels:
            raise OmniClientError(f"an input video has {count} frames of {width}x{height} pixels; this server "
                                  f"takes at most {limits.max_video_frames} frames of {limits.max_image_pixels} "
                                  "pixels (--max-input-video-frames, --max-input-image-pixels)", param="messages")
