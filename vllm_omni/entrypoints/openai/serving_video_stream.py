"""`/v1/realtime/video`: generate a video and stream it as fragmented MP4 over a WebSocket.

Protocol (JSON text messages, binary media):
  client -> `session.start` {prompt, sampling_params?: {...}, input_reference?: data URL, output_format?: "fmp4",
            frames_per_chunk?: int}, `session.stop`, `session.ping`
  server -> `video.start` {fps, width, height, num_frames (asked for), codec, container, mime_type, and for a
            clip with a soundtrack (LTX-2) audio_codec "flac", sample_rate, channels}, then per
            fragment a `video.chunk_metadata` {index, frame_start, frame_end, timestamp_start, timestamp_end,
            num_bytes} followed by one binary message (the first carries the init segment; the concatenation of
            all binary messages is one playable MP4), then `session.done` {timing}; `session.pong`;
            `error` {code, message}.
Frames are encoded as the engine decodes them: pipelines that stream (Wan) hand over each temporally decoded
chunk, which becomes one fragment, sent once the muxer has closed it (when the next chunk arrives, or at the
end), so the first fragment leaves long before the last frame is decoded. A model that returns the whole clip
at once is cut into `frames_per_chunk`-frame fragments after generation, its soundtrack (LTX-2) cut with the
frames so that each fragment carries the audio of its frames. Encoding runs in a thread. The
client closing the socket or sending `session.stop` cancels the generation, which aborts the request in the
engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from typing import Any

import numpy as np
from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError
from vllm.utils import random_uuid

from vllm_omni.diffusion.video_utils import FragmentedMp4Writer
from vllm_omni.entrypoints.openai.errors import _describe_validation_errors
from vllm_omni.entrypoints.openai.protocol.videos import VideoGenerationRequest
from vllm_omni.entrypoints.openai.serving_video import DEFAULT_FPS, DEFAULT_NUM_FRAMES, OmniOpenAIServingVideo
from vllm_omni.errors import OmniClientError, OmniError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

IDLE_TIMEOUT_S = 600.0
"""A session with no client message and nothing running for this long is closed."""
SEND_TIMEOUT_S = 60.0
"""A client that does not take a message for this long is dropped (a stalled reader never blocks others)."""
DEFAULT_FRAMES_PER_CHUNK = 4


class OmniStreamingVideoOutputHandler:
    def __init__(self, serving: OmniOpenAIServingVideo) -> None:
        self.serving = serving

    async def handle(self, ws: WebSocket) -> None:
        await ws.accept()
        task: asyncio.Task | None = None
        try:
            while True:
                timeout = None if task is not None and not task.done() else IDLE_TIMEOUT_S
                try:
                    frame = await asyncio.wait_for(ws.receive(), timeout)
                except TimeoutError:
                    await self._send(ws, {"type": "error", "code": "idle_timeout",
                                          "message": f"no message for {IDLE_TIMEOUT_S:g} s"})
                    await _close(ws, 1000)
                    return
                if frame["type"] == "websocket.disconnect":
                    return
                if frame.get("text") is None:  # the protocol is JSON text; binary frames are a client bug
                    await self._error(ws, "unsupported_data", "send JSON text messages, not binary frames")
                    await _close(ws, 1003)
                    return
                msg = self._parse(frame["text"])
                kind = msg.get("type") if msg is not None else None
                if msg is None:
                    await self._error(ws, "invalid_json", "messages must be JSON objects with a 'type'")
                elif kind == "session.ping":
                    await self._send(ws, {"type": "session.pong"})
                elif kind == "session.stop":
                    await _cancel(task)
                    task = None
                    await self._send(ws, {"type": "session.stopped"})
                elif kind == "session.start":
                    if task is not None and not task.done():
                        await self._error(ws, "session_busy", "a generation is already running; send session.stop")
                    else:
                        task = asyncio.create_task(self._run(ws, msg))
                else:
                    await self._error(ws, "unknown_type", f"unknown message type {kind!r}", param="type")
        except WebSocketDisconnect:
            pass
        finally:
            await _cancel(task)

    @staticmethod
    def _parse(raw: str) -> dict[str, Any] | None:
        try:
            msg = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser's stack
            return None
        return msg if isinstance(msg, dict) else None

    def _request(self, msg: dict[str, Any]) -> VideoGenerationRequest:
        params = msg.get("sampling_params")
        params = {} if params is None else params  # an empty list is not "absent": it would run the defaults
        if not isinstance(params, dict):
            raise OmniClientError("sampling_params must be an object", param="sampling_params")
        body = {**params, "prompt": msg.get("prompt")}
        if msg.get("input_reference") is not None:
            body["input_reference"] = msg["input_reference"]
        try:
            return VideoGenerationRequest.model_validate(body)
        except ValidationError as exc:
            message, param = _describe_validation_errors(list(exc.errors()))
            raise OmniClientError(message, param=param) from exc

    async def _run(self, ws: WebSocket, msg: dict[str, Any]) -> None:
        start = time.perf_counter()
        try:
            if msg.get("output_format", "fmp4") != "fmp4":
                raise OmniClientError("output_format must be fmp4", param="output_format")
            chunk = msg.get("frames_per_chunk", DEFAULT_FRAMES_PER_CHUNK)
            if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
                raise OmniClientError("frames_per_chunk must be a positive integer", param="frames_per_chunk")
            request = self._request(msg)
            prompt, params = await self.serving.build_inputs(request, None)
            params = [dataclasses.replace(p, stream_partial_outputs=True)
                      if isinstance(p, OmniDiffusionSamplingParams) else p for p in params]
            asked = next((p.num_frames for p in params if isinstance(p, OmniDiffusionSamplingParams)), None)
            sender = _FragmentSender(ws, asked or DEFAULT_NUM_FRAMES, start)
            try:
                durations, cache = await self._stream(sender, prompt, params, chunk)
            finally:
                await sender.close()
            await self._send(ws, {"type": "session.done", "cache": cache, "timing": {
                "total_s": time.perf_counter() - start, "first_chunk_s": sender.first_chunk_s,
                "final_output_s": sender.final_output_s,
                "num_chunks": sender.index, **durations}})
        except asyncio.CancelledError:
            raise
        except OmniClientError as exc:
            await self._error(ws, "invalid_request", exc.message, param=exc.param)
        except OmniError as exc:
            await self._error(ws, "engine_error", str(exc))
        except (WebSocketDisconnect, RuntimeError, TimeoutError):
            logger.info("video stream client went away; generation stopped")
        except Exception as exc:
            logger.exception("video stream failed")
            await self._error(ws, "internal_error", f"{type(exc).__name__}: {exc}")

    async def _stream(self, sender: _FragmentSender, prompt: dict, params: list[Any], frames_per_chunk: int
                      ) -> tuple[dict[str, float], dict[str, Any] | None]:
        """Feed the engine's video chunks to `sender` as they come; a clip that only arrives whole is cut into
        `frames_per_chunk` fragments. Returns the request's stage durations and cache summary."""
        durations: dict[str, float] = {}
        final = cache = None
        async for out in self.serving.generate(prompt, f"video-ws-{random_uuid()}", params):
            mm = out.multimodal_output or {}
            if "video_chunk" in mm:
                await sender.add(_first_video(mm["video_chunk"]), int(mm.get("fps") or DEFAULT_FPS))
            elif out.finished:  # a streamed clip's final carries no frames: they went out as chunks
                final, durations, cache = mm, dict(out.stage_durations), out.cache
                sender.final_output_s = time.perf_counter() - sender.started
        if final is None or (sender.writer is None and "video" not in final):
            raise OmniClientError(f"`{self.serving.model_name}` returned no video for this request", status_code=422)
        if sender.writer is None:
            frames, fps = _first_video(final["video"]), int(final.get("fps") or DEFAULT_FPS)
            audio = _first_audio(final)  # cut with the frames: each fragment carries its frames' share
            num_frames = frames.shape[0]
            for first in range(0, num_frames, frames_per_chunk):
                last = min(first + frames_per_chunk, num_frames)
                track = None if audio is None else \
                    audio[:, first * audio.shape[1] // num_frames:last * audio.shape[1] // num_frames]
                await sender.add(frames[first:last], fps, track, final.get("sample_rate"))
        await sender.finish()
        return durations, cache

    async def _error(self, ws: WebSocket, code: str, message: str, param: str | None = None) -> None:
        await self._send(ws, {"type": "error", "code": code, "message": message, "param": param})

    @staticmethod
    async def _send(ws: WebSocket, msg: dict[str, Any]) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await asyncio.wait_for(ws.send_text(json.dumps(msg)), SEND_TIMEOUT_S)


class _FragmentSender:
    """Encodes frame chunks into one fragmented MP4 (in a thread) and sends every finished fragment."""

    def __init__(self, ws: WebSocket, num_frames: int, started: float) -> None:
        self.ws = ws
        self.num_frames = num_frames
        self.started = started
        self.writer: FragmentedMp4Writer | None = None
        self.pending = b""
        self.frames_sent = 0
        self.index = 0
        self.first_chunk_s: float | None = None
        self.final_output_s: float | None = None
        """When the engine's final output (the whole clip) reached the server, since the session started."""
        self._encoding: asyncio.Future | None = None

    async def add(self, frames: np.ndarray, fps: int, audio: np.ndarray | None = None,
                  sample_rate: int | None = None) -> None:
        """Frames (and, for a clip with a soundtrack, the float waveform they cover) as the next fragment."""
        if self.writer is None:
            height, width = frames.shape[1:3]
            channels = 0 if audio is None else audio.shape[0]
            self.writer = FragmentedMp4Writer(fps, width, height, sample_rate=sample_rate, channels=channels)
            codecs = "avc1" if audio is None else "avc1, fLaC"
            start = {"type": "video.start", "fps": fps, "width": width, "height": height,
                     "num_frames": self.num_frames, "codec": "h264", "container": "fmp4",
                     "mime_type": f'video/mp4; codecs="{codecs}"'}
            if audio is not None:
                start.update(audio_codec="flac", sample_rate=sample_rate, channels=channels)
            await OmniStreamingVideoOutputHandler._send(self.ws, start)
        await self._flush(await self._encode(self.writer.write, frames, audio))

    async def finish(self) -> None:
        await self._flush(await self._encode(self.writer.close))

    async def _encode(self, fn: Any, *args: Any) -> bytes:
        """One writer call in a thread. The writer is not thread-safe, and a cancelled session's thread runs on:
        the call is shielded so that `close` can wait for it (closing it meanwhile crashed the server)."""
        self._encoding = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        return await asyncio.shield(self._encoding)

    async def _flush(self, data: bytes) -> None:
        self.pending += data
        done = self.writer.frames_flushed
        if done == self.frames_sent:  # only the init segment so far: it rides with the first fragment
            return
        payload, self.pending = self.pending, b""
        fps = self.writer.fps
        await OmniStreamingVideoOutputHandler._send(self.ws, {
            "type": "video.chunk_metadata", "index": self.index, "frame_start": self.frames_sent,
            "frame_end": done, "timestamp_start": self.frames_sent / fps, "timestamp_end": done / fps,
            "num_bytes": len(payload)})
        await asyncio.wait_for(self.ws.send_bytes(payload), SEND_TIMEOUT_S)
        if self.first_chunk_s is None:
            self.first_chunk_s = time.perf_counter() - self.started
        self.frames_sent = done
        self.index += 1

    async def close(self) -> None:
        """Frees the encoder once no call of it runs (also when the session was cancelled mid-chunk)."""
        if self.writer is None:
            return
        with contextlib.suppress(Exception):
            if self._encoding is not None:
                await asyncio.wait([self._encoding])
            await asyncio.to_thread(self.writer.close)


def _first_video(video: Any) -> np.ndarray:
    """(T, H, W, 3) of the first output when a request asked for several (N, T, H, W, 3)."""
    frames = np.asarray(video)
    return frames[0] if frames.ndim == 5 else frames


def _first_audio(final: dict[str, Any]) -> np.ndarray | None:
    """(channels, samples) soundtrack of the first output (None: the model makes no sound)."""
    if final.get("audio") is None:
        return None
    audio = np.asarray(final["audio"])
    audio = audio[0] if np.asarray(final["video"]).ndim == 5 else audio
    return audio[None] if audio.ndim == 1 else audio


async def _close(ws: WebSocket, code: int) -> None:
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):
        await asyncio.wait_for(ws.close(code=code), SEND_TIMEOUT_S)


async def _cancel(task: asyncio.Task | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, 30.0)
