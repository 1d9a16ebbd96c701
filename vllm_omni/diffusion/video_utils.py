"""Video helpers: float->uint8 frames, streamed clips joined back, and MP4 (H.264) encoding with PyAV, with the
clip's soundtrack muxed in when the model made one (FLAC: lossless, so the track decodes to the waveform).

Decoding runs in the worker (it is part of the pipeline); MP4 encoding is CPU work the serving layer does
in a thread (`asyncio.to_thread(encode_mp4, ...)`), off the engine's critical path.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

DEFAULT_CODEC = "libx264"
AUDIO_CODEC = "flac"
"""Soundtrack codec: lossless (the MP4's audio decodes to the model's waveform at 16-bit) and playable in MP4 by
browsers and players."""
STREAMED_FRAMES = "streamed_frames"
"""Key of a final video output whose frames were all sent before it as "video_chunk" partials: the clip
crosses every process boundary once, as its chunks; a caller that wants the whole clip joins the chunks it read
(`join_streamed_video`)."""


def join_streamed_video(output: dict[str, Any], chunks: list[np.ndarray]) -> dict[str, Any]:
    """`output` with its "video" rebuilt from the request's chunks (frame axis: (T, H, W, 3) or (n, T, H, W, 3))
    when the pipeline streamed them instead of sending the clip again; any other output unchanged."""
    num_frames = output.get(STREAMED_FRAMES)
    if num_frames is None:
        return output
    video = np.concatenate(chunks, axis=chunks[0].ndim - 4) if chunks else None
    if video is None or video.shape[-4] != num_frames:
        got = 0 if video is None else video.shape[-4]
        raise RuntimeError(f"the streamed video has {got} of its {num_frames} frames (a chunk was lost)")
    joined = {k: v for k, v in output.items() if k != STREAMED_FRAMES}
    return {**joined, "video": video}


def to_uint8_frames(video: torch.Tensor) -> np.ndarray:
    """(B, 3, T, H, W) in [-1, 1] -> uint8 (B, T, H, W, 3), rounding like diffusers' `output_type="np"` * 255."""
    import torch

    video = ((video.float() / 2 + 0.5).clamp(0, 1) * 255).round()
    return video.permute(0, 2, 3, 4, 1).to(torch.uint8).cpu().numpy()


def encode_mp4(frames: np.ndarray, fps: int, *, codec: str = DEFAULT_CODEC, crf: int = 18,
               fragmented: bool = False, gop: int | None = None, audio: np.ndarray | None = None,
               sample_rate: int | None = None) -> bytes:
    """Encode uint8 frames (T, H, W, 3) as an H.264 MP4 (yuv420p; odd sizes are edge-padded to even), with
    `audio` (float waveform (channels, samples) or (samples,) in [-1, 1] at `sample_rate`) as a FLAC track.

    `fragmented=True` writes a fragmented MP4 (moov up front, one fragment per keyframe) that a player can
    append chunk by chunk, as the WebSocket video stream needs; `gop` fixes the keyframe interval (so each
    fragment holds exactly `gop` frames).
    """
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 (T, H, W, 3), got {frames.dtype} {frames.shape}")
    if fps < 1:
        raise ValueError(f"fps must be >= 1, got {fps}")
    pcm = None if audio is None else to_pcm16(audio, sample_rate)
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    if fragmented:
        buf = io.BytesIO()
        _write_mp4(buf, frames, fps, codec, crf, {"movflags": "frag_keyframe+empty_moov+default_base_moof"}, gop,
                   pcm, sample_rate)
        return buf.getvalue()
    # faststart (moov before the media, so players can start while downloading) rewrites the file in a second
    # pass that needs a real path.
    with tempfile.TemporaryDirectory(prefix="vllm-omni-mp4-") as tmp:
        path = Path(tmp) / "video.mp4"
        _write_mp4(str(path), frames, fps, codec, crf, {"movflags": "faststart"}, gop, pcm, sample_rate)
        return path.read_bytes()


def to_pcm16(audio: np.ndarray, sample_rate: int | None) -> np.ndarray:
    """A float waveform ((channels, samples) or (samples,), in [-1, 1]) as int16 (channels, samples)."""
    audio = np.asarray(audio)
    if audio.ndim == 1:
        audio = audio[None]
    if audio.ndim != 2 or audio.shape[0] not in (1, 2) or not np.issubdtype(audio.dtype, np.floating):
        raise ValueError(f"audio must be a float (channels<=2, samples) waveform, got {audio.dtype} {audio.shape}")
    if not sample_rate or sample_rate < 1:
        raise ValueError(f"a soundtrack needs its sample_rate, got {sample_rate}")
    return np.round(np.clip(audio, -1.0, 1.0) * 32767).astype(np.int16)


def _add_audio_stream(container: Any, pcm: np.ndarray, sample_rate: int) -> Any:
    stream = container.add_stream(AUDIO_CODEC, rate=sample_rate)
    stream.layout = "stereo" if pcm.shape[0] == 2 else "mono"
    stream.format = "s16"
    return stream


def _audio_packets(stream: Any, pcm: np.ndarray, sample_rate: int, first_sample: int) -> list[Any]:
    """`pcm` (int16 (channels, samples)) starting at sample `first_sample` of the track, encoded."""
    import av

    if pcm.shape[1] == 0:
        return []
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm.T).reshape(1, -1), format="s16",
                                       layout="stereo" if pcm.shape[0] == 2 else "mono")
    frame.sample_rate, frame.pts = sample_rate, first_sample
    return list(stream.encode(frame))


def _write_mp4(target: Any, frames: np.ndarray, fps: int, codec: str, crf: int, options: dict[str, str],
               gop: int | None, pcm: np.ndarray | None, sample_rate: int | None) -> None:
    import av

    with av.open(target, mode="w", format="mp4", options=options) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        if codec == DEFAULT_CODEC:
            x264 = f"keyint={gop}:min-keyint={gop}:scenecut=0:bframes=0" if gop else ""
            stream.options = {"crf": str(crf), **({"x264-params": x264} if x264 else {})}
        audio_stream = None if pcm is None else _add_audio_stream(container, pcm, sample_rate)
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if audio_stream is not None:
            for packet in [*_audio_packets(audio_stream, pcm, sample_rate, 0), *audio_stream.encode()]:
                container.mux(packet)


class FragmentedMp4Writer:
    """Incremental H.264 fragmented MP4 for streaming: each `write(frames)` starts a new fragment (an IDR
    frame) at the chunk's first frame and returns the bytes the muxer has finished, `close()` the rest; all the
    returned bytes concatenated are one playable MP4.

    The muxer closes a fragment only when the next one starts, so a `write` returns the fragments of the
    chunks before it (the first one returns just the init segment); `frames_flushed` says how many frames the
    returned bytes cover so far. Not thread-safe: call it from one thread at a time.
    """

    def __init__(self, fps: int, width: int, height: int, *, codec: str = DEFAULT_CODEC, crf: int = 18,
                 sample_rate: int | None = None, channels: int = 0) -> None:
        """`channels` > 0: the clip has a soundtrack at `sample_rate`, each `write` carries its chunk's samples."""
        import av

        if fps < 1:
            raise ValueError(f"fps must be >= 1, got {fps}")
        self.fps = fps
        self._pad = (height % 2, width % 2)
        self._sink = _ByteSink()
        self._frames = 0
        self.frames_flushed = 0
        self._container = av.open(self._sink, mode="w", format="mp4",
                                  options={"movflags": "frag_keyframe+empty_moov+default_base_moof"})
        self._stream = self._container.add_stream(codec, rate=fps)
        self._stream.width, self._stream.height = width + self._pad[1], height + self._pad[0]
        self._stream.pix_fmt = "yuv420p"
        if codec == DEFAULT_CODEC:  # no lookahead / B-frames: packets leave the encoder with their frame
            self._stream.options = {"crf": str(crf), "tune": "zerolatency", "forced-idr": "1",
                                    "x264-params": "keyint=100000:scenecut=0:bframes=0"}
        self._audio = None
        self._samples = 0
        if channels:
            self._audio = _add_audio_stream(self._container, np.zeros((channels, 0), np.int16), sample_rate)
            self.sample_rate = sample_rate
        self._closed = False

    def write(self, frames: np.ndarray, audio: np.ndarray | None = None) -> bytes:
        """Encode uint8 frames (T, H, W, 3) as the next fragment, with `audio` (the float waveform these frames
        cover) when the clip has a soundtrack; returns the newly finished bytes."""
        import av

        if (audio is None) != (self._audio is None):
            raise ValueError("audio must come with every chunk of a clip with a soundtrack, and only then")
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(f"frames must be uint8 (T, H, W, 3), got {frames.dtype} {frames.shape}")
        if any(self._pad):
            frames = np.pad(frames, ((0, 0), (0, self._pad[0]), (0, self._pad[1]), (0, 0)), mode="edge")
        for i, frame in enumerate(frames):
            video_frame = av.VideoFrame.from_ndarray(frame, format="rgb24")
            video_frame.pts = self._frames
            if i == 0:
                video_frame.pict_type = av.video.frame.PictureType.I
            self._frames += 1
            self._mux(self._stream.encode(video_frame))
        if self._audio is not None:
            pcm = to_pcm16(audio, self.sample_rate)
            self._mux_audio(_audio_packets(self._audio, pcm, self.sample_rate, self._samples))
            self._samples += pcm.shape[1]
        return self._sink.take()

    def close(self) -> bytes:
        """Flush the encoder and the last fragment; returns the remaining bytes (idempotent)."""
        if self._closed:
            return b""
        self._closed = True
        try:
            self._mux(self._stream.encode())
            if self._audio is not None:
                self._mux_audio(self._audio.encode())
        finally:
            self._container.close()
        self.frames_flushed = self._frames
        return self._sink.take()

    def _mux(self, packets: list[Any]) -> None:
        for packet in packets:
            if packet.is_keyframe and packet.pts is not None:
                # Everything before this keyframe now sits in finished fragments.
                self.frames_flushed = round(float(packet.pts * packet.time_base) * self.fps)
            self._container.mux(packet)

    def _mux_audio(self, packets: list[Any]) -> None:
        for packet in packets:
            self._container.mux(packet)



class _ByteSink:
    """The file PyAV writes to; not seekable, which the fragmented muxer does not need."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def write(self, data: bytes) -> int:
        self._buffer += data
        return len(data)

    def take(self) -> bytes:
        data = bytes(self._buffer)
        self._buffer.clear()
        return data


def split_fmp4(data: bytes) -> tuple[bytes, list[bytes]]:
    """Fragmented MP4 -> (init segment: ftyp + moov, [moof + mdat per fragment]); trailing boxes join the last."""
    init, fragments, current = b"", [], b""
    pos = 0
    while pos + 8 <= len(data):
        size = int.from_bytes(data[pos:pos + 4], "big")
        kind = data[pos + 4:pos + 8]
        if size == 1:
            size = int.from_bytes(data[pos + 8:pos + 16], "big")
        elif size == 0:
            size = len(data) - pos
        box = data[pos:pos + size]
        pos += size
        if kind in (b"ftyp", b"moov") and not fragments and not current:
            init += box
        elif kind == b"moof" and current:
            fragments.append(current)
            current = box
        else:
            current += box
    if current:
        fragments.append(current)
    return init, fragments


def decode_mp4(data: bytes) -> np.ndarray:
    """MP4 bytes -> uint8 frames (T, H, W, 3); used by tests and clients to check what was encoded."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def decode_mp4_audio(data: bytes) -> tuple[np.ndarray, int] | None:
    """MP4 bytes -> its soundtrack as float32 (channels, samples) and the sample rate (None without one); used by
    tests and clients to check what was muxed."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        channels = stream.codec_context.channels
        # s16 packed: one row of interleaved samples per frame.
        pcm = np.concatenate([f.to_ndarray().reshape(-1, channels).T for f in container.decode(stream)], axis=1)
        return pcm.astype(np.float32) / 32767, stream.codec_context.sample_rate
