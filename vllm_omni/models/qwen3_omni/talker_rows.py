"""Per-request identity of the talker's rows, through vLLM's KV-connector plugin interface and worker extension.

The talker model needs, at every forward, which request owns which rows of the flattened batch (and that request's
`SamplingParams.extra_args`, its conditioning), and to hear when a request finished so its frames become
collectable. vLLM's model interface passes neither, so the talker stage runs with `TalkerRowsConnector`
(`kv_transfer_config.kv_connector_module_path`), which moves no KV: its scheduler side sends, each step, every
scheduled request's KV block ids and (when new or resumed) its `extra_args`, plus the finished request ids; the
model maps each row to its request by the row's KV slot (`slot_mapping` of vLLM's forward context; a block belongs
to one request). `TalkerFramesExtension` (`worker_extension_cls`) serves the frame RPCs. Nothing assumes a CPU
worker or reads runner internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole

from vllm_omni.models.qwen3_omni.slot_connector import SlotConnector, slot_connector_engine_kwargs

CONNECTOR = "TalkerRowsConnector"
MODULE = "vllm_omni.models.qwen3_omni.talker_rows"


def talker_rows_engine_kwargs() -> dict[str, Any]:
    return slot_connector_engine_kwargs(CONNECTOR, MODULE, "TalkerFramesExtension")


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
        return False, None

    # ---- worker side ---------------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: RowsMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._extra_args.update(connector_metadata.extra_args)
        for req_id in connector_metadata.finished:
            self._extra_args.pop(req_id, None)
        self._finished |= connector_metadata.finished

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
