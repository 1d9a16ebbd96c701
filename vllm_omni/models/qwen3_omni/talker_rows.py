"""Per-request identity of the talker's rows, through vLLM's KV-connector plugin interface and worker extension.

The talker model needs, at every forward, which request owns which rows of the flattened batch (and that request's
`SamplingParams.extra_args`, its conditioning), and to hear when a request finished so its frames become
collectable. vLLM's model interface passes neither, so the talker stage runs with `TalkerRowsConnector`
(`kv_transfer_config.kv_connector_module_path`), which moves no KV: its scheduler side sends, each step, every
scheduled request's KV block ids and (when new or resumed) its `extra_args`, plus the finished request ids; the
model maps each row to its request by the row's KV slot (`slot_mapping` of vLLM's forward context; a block belongs
to one request). Each frame the model completes goes back with the step's output and out on the request's outputs
(slot_connector.py): every output carries all of the request's frames so far, so an output vLLM's per-request
queue merges into a later one loses nothing. `TalkerFramesExtension` (`worker_extension_cls`) serves the frames
to direct callers (tests, benchmarks). Nothing assumes a CPU worker or reads runner internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole

from vllm_omni.models.qwen3_omni.slot_connector import SlotConnector, slot_connector_engine_kwargs

CONNECTOR = "TalkerRowsConnector"
MODULE = "vllm_omni.models.qwen3_omni.talker_rows"


def talker_rows_engine_kwargs() -> dict[str, Any]:
    return slot_connector_engine_kwargs(CONNECTOR, MODULE, "TalkerFramesExtension", async_scheduling=False)


def frames_from_stage_data(data: dict[str, Any]) -> list[list[int]]:
    """The codec frames of a talker output's in-band stage data (`TalkerRowsConnector.stage_data`)."""
    if "error" in data:
        raise RuntimeError(f"talker request failed: {data['error']}")
    if "codec_frames" not in data:
        return []
    codes = np.frombuffer(data["codec_frames"], dtype=np.int32)
    return codes.reshape(-1, data["codebooks"]).tolist()


@dataclass
class RowsMetadata(KVConnectorMetadata):
    block_size: int
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    """Every request scheduled this step: its KV blocks (group 0), in order."""
    extra_args: dict[str, dict | None] = field(default_factory=dict)
    """Requests new or resumed this step (a streaming-input chunk brings new params): their `extra_args`."""
    finished: set[str] = field(default_factory=set)


@dataclass
class RequestRows:
    """Rows [start, end) of this step's flattened batch belong to request `req_id`."""

    req_id: str
    start: int
    end: int
    extra_args: dict | None


class TalkerRowsConnector(SlotConnector):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._blocks: dict[str, list[int]] = {}  # scheduler side
        self._extra_args: dict[str, dict | None] = {}  # worker side: the latest params of each running request
        self._finished: set[str] = set()  # worker side: finished, not yet handed to the model
        self._frames: dict[str, bytearray] = {}  # scheduler side: each running request's frames (int32 codes)
        self._codebooks: dict[str, int] = {}
        self._errors: dict[str, str] = {}

    # ---- scheduler side ----------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> RowsMetadata:
        meta = RowsMetadata(block_size=self._block_size, finished=set(scheduler_output.finished_req_ids))
        for req_id in meta.finished:
            self._blocks.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            params = new.sampling_params
            meta.extra_args[new.req_id] = params.extra_args if params is not None else None
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                blocks = list(new_blocks[0])
                self._blocks[req_id] = blocks if req_id in cached.resumed_req_ids else self._blocks[req_id] + blocks
        meta.block_ids = {r: self._blocks[r] for r in scheduler_output.num_scheduled_tokens if r in self._blocks}
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._blocks.pop(request.request_id, None)
        return super().request_finished(request, block_ids)

    def received(self, req_id: str, data: dict[str, Any]) -> None:
        if "error" in data:
            self._errors.setdefault(req_id, data["error"])
        if data.get("frames"):
            codes = np.asarray(data["frames"], dtype=np.int32)
            self._codebooks[req_id] = codes.shape[1]
            self._frames.setdefault(req_id, bytearray()).extend(codes.tobytes())

    def stage_data(self, req_id: str, finished: bool) -> dict[str, Any] | None:
        """All frames so far (or the request's error): a frame is 16 int32 codes, so a 4096-frame request's last
        outputs carry 256 KiB each."""
        if req_id in self._errors:
            return {"error": self._errors[req_id]}
        if req_id not in self._frames:
            return None
        return {"codec_frames": bytes(self._frames[req_id]), "codebooks": self._codebooks[req_id]}

    def forget(self, req_id: str) -> None:
        self._frames.pop(req_id, None)
        self._codebooks.pop(req_id, None)
        self._errors.pop(req_id, None)

    # ---- worker side ---------------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: RowsMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._extra_args.update(connector_metadata.extra_args)
        for req_id in connector_metadata.finished:
            self._extra_args.pop(req_id, None)
        self._finished |= connector_metadata.finished

    def send(self, req_id: str, frame: list[int] | None = None, error: str | None = None) -> None:
        """A frame the model completed this step (or the request's error), out with the step's output."""
        data = self._outbox.setdefault(req_id, {})
        if frame is not None:
            data.setdefault("frames", []).append(frame)
        if error is not None:
            data["error"] = error

    def drain_finished(self) -> set[str]:
        """Requests finished since the last call (a step without a forward also reports some)."""
        finished, self._finished = self._finished, set()
        return finished

    def request_rows(self, slot_mapping: torch.Tensor) -> list[RequestRows]:
        """Each scheduled request's rows of this forward (`slot_mapping`: KV slot per row), in batch order."""
        meta = self._connector_metadata
        if not isinstance(meta, RowsMetadata) or not meta.block_ids:
            return []
        blocks = slot_mapping // meta.block_size
        rows = []
        for req_id, owned in meta.block_ids.items():
            mine = torch.nonzero(torch.isin(blocks, torch.tensor(owned, dtype=blocks.dtype, device=blocks.device)))
            if mine.numel():
                start, end = int(mine.min()), int(mine.max()) + 1
                rows.append(RequestRows(req_id, start, end, self._extra_args.get(req_id)))
        return sorted(rows, key=lambda r: r.start)


class TalkerFramesExtension:
    """Worker extension (`worker_extension_cls`): the talker's frame RPCs for its stage's output collector."""

    def take_talker_frames(self, keys: list[str]) -> dict[str, list[list[int]] | None]:
        model = self.model_runner.get_model()
        model.sync_finished()
        return model.take_frames(keys)

    def peek_talker_frames(self, keys: list[str]) -> dict[str, list[list[int]]]:
        model = self.model_runner.get_model()
        model.sync_finished()
        return model.peek_frames(keys)
