"""`/v1/realtime/video`: generate a video and stream it as fragmented MP4 over a WebSocket.

Protocol (JSON text messages, binary media):
  client -> `session.start` {prompt, sampling_params?: {...}, input_reference?: data URL, output_format?: "fmp4",
            frames_per_chunk?: int}, `session.stop`, `session.ping`
  server -> `video.start` {fps, width, height, num_frames, codec, container, mime_type}, then per chunk a
            `video.chunk_metadata` {index, frame_start, frame_end, timestamp_start, timestamp_end, num_bytes}
            followed by one binary message (chunk 0 carries the init segment; the concatenation of all binary
            messages is one playable MP4), then `session.done` {timing}; `session.pong`; `error` {code, message}.
The client closing the socket or sending `session.stop` cancels the generation, which aborts the request in
the engine. Chunks are cut after generation: the engine returns the whole clip at once today, so the first
chunk arrives after the last frame is decoded (see docs/video.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError
from vllm.logger import init_logger
from vllm.utils import random_uuid

from vllm_omni.diffusion.video_utils import encode_mp4, split_fmp4
from vllm_omni.entrypoints.openai.errors import _describe_validation_errors
from vllm_omni.entrypoints.openai.protocol.videos import VideoGenerationRequest
from vllm_omni.entrypoints.openai.serving_video import OmniOpenAIServingVideo
from vllm_omni.errors import OmniClientError, OmniError

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
                    raw = await asyncio.wait_for(ws.receive_text(), timeout)
                except TimeoutError:
                    await self._send(ws, {"type": "error", "code": "idle_timeout",
                                          "message": f"no message for {IDLE_TIMEOUT_S:g} s"})
                    return
                msg = self._parse(raw)
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
                    await self._error(ws, "unknown_type", f"unknown message type {kind!r}")
        except WebSocketDisconnect:
            pass
        finally:
            await _cancel(task)

    @staticmethod
    def _parse(raw: str) -> dict[str, Any] | None:
        try:
            msg = json.loads(raw)
        except ValueError:
            return None
        return msg if isinstance(msg, dict) else None

    def _request(self, msg: dict[str, Any]) -> VideoGenerationRequest:
        params = msg.get("sampling_params") or {}
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
            prompt, params = self.serving.build_inputs(request, None)
            videos, durations = await self.serving.generate_videos(prompt, f"video-ws-{random_uuid()}", params)
            video = videos[0]
            data = await asyncio.to_thread(encode_mp4, video.frames, video.fps, fragmented=True, gop=chunk)
            init, fragments = split_fmp4(data)
            num_frames, height, width = video.frames.shape[:3]
            await self._send(ws, {"type": "video.start", "fps": video.fps, "width": width, "height": height,
                                  "num_frames": num_frames, "codec": "h264", "container": "fmp4",
                                  "mime_type": 'video/mp4; codecs="avc1"', "num_chunks": len(fragments)})
            for index, fragment in enumerate(fragments):
                payload = init + fragment if index == 0 else fragment
                first, last = index * chunk, min((index + 1) * chunk, num_frames)
                await self._send(ws, {"type": "video.chunk_metadata", "index": index, "frame_start": first,
                                      "frame_end": last, "timestamp_start": first / video.fps,
                                      "timestamp_end": last / video.fps, "num_bytes": len(payload)})
                await asyncio.wait_for(ws.send_bytes(payload), SEND_TIMEOUT_S)
            await self._send(ws, {"type": "session.done",
                                  "timing": {"total_s": time.perf_counter() - start, **durations}})
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

    async def _error(self, ws: WebSocket, code: str, message: str, param: str | None = None) -> None:
        await self._send(ws, {"type": "error", "code": code, "message": message, "param": param})

    @staticmethod
    async def _send(ws: WebSocket, msg: dict[str, Any]) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await asyncio.wait_for(ws.send_text(json.dumps(msg)), SEND_TIMEOUT_S)


async def _cancel(task: asyncio.Task | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, 30.0)
