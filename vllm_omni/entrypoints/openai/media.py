"""Encoding/decoding of media that travels inside JSON: base64 images, data URLs and WAV audio."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import wave
from typing import Any

import numpy as np

from vllm_omni.errors import OmniClientError

_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def encode_image_b64(image: Any, fmt: str = "png", quality: int | None = None) -> str:
    """`quality` (0-100, jpeg / webp): the encoder's quality; None: PIL's default."""
    buf = io.BytesIO()
    image.save(buf, format=_PIL_FORMATS[fmt], **({} if quality is None else {"quality": quality}))
    return base64.b64encode(buf.getvalue()).decode("ascii")


def image_data_url(image: Any, fmt: str = "png") -> str:
    return f"data:image/{fmt};base64,{encode_image_b64(image, fmt)}"


def probe_image(data: bytes, param: str, max_pixels: int) -> Any:
    """Open an uploaded image's header only: not an image, or more pixels than `max_pixels`, is a 400 naming
    `param` before anything is decoded (a small PNG may expand to gigabytes). Cheap; returns the lazy image."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise OmniClientError(f"{param} is not a readable image: {exc}", param=param) from exc
    width, height = image.size
    if width * height > max_pixels:
        raise OmniClientError(f"{param} is {width}x{height} = {width * height} pixels, more than this server "
                              f"decodes ({max_pixels}; see --max-input-image-pixels)", param=param)
    return image


def decode_image_bytes(data: bytes, param: str, max_pixels: int) -> Any:
    """Decode an uploaded image to RGB after `probe_image`. CPU-bound: call it off the event loop
    (`decode_image_async`)."""
    from PIL import Image, UnidentifiedImageError

    image = probe_image(data, param, max_pixels)
    try:
        image.load()
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise OmniClientError(f"{param} is not a readable image: {exc}", param=param) from exc


async def decode_image_async(data: bytes, param: str, max_pixels: int) -> Any:
    return await asyncio.to_thread(decode_image_bytes, data, param, max_pixels)


def data_url_bytes(url: str, param: str, max_bytes: int) -> bytes:
    """The payload of a base64 `data:` URL. Only `data:` URLs: the server never fetches remote media on a
    client's behalf."""
    if not url.startswith("data:"):
        raise OmniClientError(f"{param} must be a data: URL (base64 image); remote URLs are not fetched",
                              param=param)
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise OmniClientError(f"{param} must be base64-encoded", param=param)
    if len(payload) * 3 // 4 > max_bytes:
        raise OmniClientError(f"{param} is larger than the {max_bytes // 2**20} MiB upload limit",
                              status_code=413, param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise OmniClientError(f"{param} is not valid base64: {exc}", param=param) from exc


async def decode_image_url(url: str, param: str, max_bytes: int, max_pixels: int) -> Any:
    """A `data:` URL image, decoded off the event loop."""
    return await decode_image_async(data_url_bytes(url, param, max_bytes), param, max_pixels)


def audio_to_pcm16(audio: Any) -> bytes:
    """float waveform in [-1, 1] (any shape; channels last or first for 2-D) -> interleaved int16 bytes."""
    if hasattr(audio, "detach"):
        audio = audio.detach().float().cpu().numpy()
    samples = np.asarray(audio, dtype=np.float32)
    samples = samples.reshape(-1) if samples.ndim != 2 else _channels_last(samples).reshape(-1)
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def _channels_last(samples: np.ndarray) -> np.ndarray:
    return samples.T if samples.shape[0] < samples.shape[1] else samples


def num_channels(audio: Any) -> int:
    shape = getattr(audio, "shape", ())
    return min(shape) if len(shape) == 2 else 1


def encode_wav(audio: Any, sample_rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wav:
        wav.setnchannels(num_channels(audio))
        wav.setsampwidth(2)
        wav.setframerate(int(sample_rate))
        wav.writeframes(audio_to_pcm16(audio))
    return buf.getvalue()


AUDIO_FORMATS: dict[str, tuple[str, str | None, str]] = {
    "wav": ("wav", None, "audio/wav"),
    "pcm": ("pcm", None, "audio/pcm"),
    "mp3": ("mp3", "libmp3lame", "audio/mpeg"),
    "opus": ("ogg", "libopus", "audio/ogg"),
    "aac": ("adts", "aac", "audio/aac"),
    "flac": ("flac", "flac", "audio/flac"),
}
"""OpenAI speech `response_format` -> (container, PyAV encoder, media type); wav / pcm need no encoder."""


def encode_audio(audio: Any, sample_rate: int, fmt: str) -> bytes:
    """A float waveform as `fmt` (see AUDIO_FORMATS). CPU-bound: call it off the event loop."""
    if fmt == "wav":
        return encode_wav(audio, sample_rate)
    if fmt == "pcm":
        return audio_to_pcm16(audio)
    import av

    container, encoder, _ = AUDIO_FORMATS[fmt]
    channels = num_channels(audio)
    layout = "mono" if channels == 1 else "stereo"
    pcm = np.frombuffer(audio_to_pcm16(audio), dtype="<i2").reshape(1, -1)  # packed s16, channels interleaved
    rates = av.codec.Codec(encoder, "w").audio_rates
    rate = int(sample_rate) if not rates or int(sample_rate) in rates else 48000
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(encoder, rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout=layout)
        frame.sample_rate = int(sample_rate)
        resampler = av.AudioResampler(format=stream.codec_context.format, layout=layout, rate=rate,
                                      frame_size=stream.codec_context.frame_size or None)
        for chunk in [*resampler.resample(frame), *resampler.resample(None)]:
            out.mux(stream.encode(chunk))
        out.mux(stream.encode(None))
    return buf.getvalue()
