"""The thinker's hidden states for the talker, out of vLLM through its KV-connector plugin interface.

The talker is conditioned, at each audio / image / video placeholder of the prompt, on the thinker's hidden
state of layer `talker_config.accept_hidden_layer` (transformers' `Qwen3OmniMoeForConditionalGeneration`), and
its M-RoPE positions follow the thinker's. vLLM gives a model forward no request identity, so:

- the scheduler side of `ThinkerHiddenStatesConnector` (loaded with `kv_transfer_config.kv_connector_module_path`)
  sends, each step, the KV blocks and multimodal prompt positions of every request still in its prompt;
- the thinker model (vllm_thinker.py) collects vLLM's aux hidden states of that layer and, through the worker-side
  connector, maps each row of the flattened batch to (request, position) by its KV slot (`slot_mapping` of the
  forward context; a block belongs to one request) — no runner internals, so it runs the same on CPU and GPU;
- a completed capture goes back with the step's output (slot_connector.py) and out in-band on the request's
  output of that step and on its last one. Should vLLM's per-request output queue merge that step's output into
  the next (a lagging reader), the collector asks the worker once (`ThinkerHiddenStatesExtension`,
  `collective_rpc("take_thinker_hidden")`), which keeps a capture until its request finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole

from vllm_omni.models.qwen3_omni.slot_connector import SlotConnector, slot_connector_engine_kwargs

CONNECTOR = "ThinkerHiddenStatesConnector"
MODULE = "vllm_omni.models.qwen3_omni.thinker_hidden"


def thinker_engine_kwargs() -> dict[str, Any]:
    """vLLM engine arguments that make the thinker export its hidden states. Prefix caching is off: a cached
    prompt block is never forwarded, so its states could not be captured."""
    return {**slot_connector_engine_kwargs(CONNECTOR, MODULE, "ThinkerHiddenStatesExtension", async_scheduling=True),
            "enable_prefix_caching": False}


@dataclass
class PromptRequest:
    """What the worker needs to capture one request's prompt rows."""

    block_ids: list[int]
    prompt_len: int
    multimodal_positions: list[int]


@dataclass
class HiddenStatesMetadata(KVConnectorMetadata):
    block_size: int
    requests: dict[str, PromptRequest] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)


@dataclass
class Capture:
    """One request's prompt: M-RoPE positions (3, P) and hidden states at its multimodal positions (M, D)."""

    positions: torch.Tensor
    multimodal_positions: torch.Tensor
    hidden: torch.Tensor | None = None
    rows: int = 0
    """Prompt rows captured (the prompt is complete at `positions.shape[1]`)."""
    sent: bool = False

    def to_builtins(self) -> dict[str, Any]:
        hidden = self.hidden if self.hidden is not None else torch.zeros(0, 0)
        return {"positions": self.positions.tolist(), "multimodal_positions": self.multimodal_positions.tolist(),
                "hidden": hidden.float().numpy().tobytes(), "hidden_shape": list(hidden.shape)}


class ThinkerHiddenStatesConnector(SlotConnector):
    """Moves no KV: it only tells the worker which request owns which KV blocks while a prompt is prefilled."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        thinker = vllm_config.model_config.hf_config
        thinker = getattr(thinker, "thinker_config", thinker)
        self._multimodal_ids = {thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id}
        self._block_size = vllm_config.cache_config.block_size
        self._prompts: dict[str, PromptRequest] = {}  # scheduler side: requests still in their prompt
        self._captures: dict[str, Capture] = {}  # worker side: until the request finished
        self._held: dict[str, dict[str, Any]] = {}  # scheduler side: completed captures, until the last output
        self._fresh: set[str] = set()  # scheduler side: completed this step

    # ---- scheduler side ----------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> HiddenStatesMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            ids = new.prompt_token_ids or []
            self._prompts[new.req_id] = PromptRequest(
                block_ids=list(new.block_ids[0]), prompt_len=len(ids),
                multimodal_positions=[i for i, t in enumerate(ids) if t in self._multimodal_ids])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            prompt = self._prompts.get(req_id)
            if prompt is None:
                continue
            if cached.num_computed_tokens[i] >= prompt.prompt_len:
                del self._prompts[req_id]  # the prompt is done; decode steps need nothing
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                blocks = list(new_blocks[0])
                prompt.block_ids = blocks if req_id in cached.resumed_req_ids else prompt.block_ids + blocks
        for req_id in scheduler_output.finished_req_ids:
            self._prompts.pop(req_id, None)
        scheduled = scheduler_output.num_scheduled_tokens
        return HiddenStatesMetadata(block_size=self._block_size,
                                    requests={r: p for r, p in self._prompts.items() if r in scheduled},
                                    finished=set(scheduler_output.finished_req_ids))

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._prompts.pop(request.request_id, None)
        return super().request_finished(request, block_ids)

    def received(self, req_id: str, data: dict[str, Any]) -> None:
        self._held[req_id] = data["thinker_hidden"]
        self._fresh.add(req_id)

    def stage_data(self, req_id: str, finished: bool) -> dict[str, Any] | None:
        """The capture on the output of the step that completed it, and on the request's last output (the only
        one a FINAL_ONLY request has)."""
        fresh = req_id in self._fresh
        self._fresh.discard(req_id)
        capture = self._held.get(req_id)
        return {"thinker_hidden": capture} if capture is not None and (fresh or finished) else None

    def forget(self, req_id: str) -> None:
        self._held.pop(req_id, None)
        self._fresh.discard(req_id)

    # ---- worker side ---------------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: HiddenStatesMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        for req_id in connector_metadata.finished:
            self._captures.pop(req_id, None)

    def capture(self, slot_mapping: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """Record this forward's prompt rows: `slot_mapping` (N,) KV slot per row, `positions` (3, N) M-RoPE
        positions, `hidden` (N, D) the thinker's states of the talker's layer."""
        meta = self._connector_metadata
        if not isinstance(meta, HiddenStatesMetadata) or not meta.requests:
            return
        blocks, offsets = slot_mapping // meta.block_size, slot_mapping % meta.block_size
        for req_id, prompt in meta.requests.items():
            capture = self._captures.get(req_id)
            if capture is None:
                capture = self._captures[req_id] = Capture(
                    positions=torch.zeros(3, prompt.prompt_len, dtype=torch.long),
                    multimodal_positions=torch.tensor(prompt.multimodal_positions, dtype=torch.long))
            owned = torch.tensor(prompt.block_ids, dtype=blocks.dtype, device=blocks.device)
            rows = torch.nonzero(torch.isin(blocks, owned)).flatten()
            if rows.numel() == 0:
                continue
            index = {b: i for i, b in enumerate(prompt.block_ids)}
            pos = torch.tensor([index[int(b)] for b in blocks[rows]], device=rows.device) * meta.block_size
            pos = pos + offsets[rows]
            in_prompt = pos < prompt.prompt_len
            rows, pos = rows[in_prompt], pos[in_prompt]
            capture.positions[:, pos.cpu()] = positions[:, rows].to("cpu", torch.long)
            self._capture_hidden(capture, rows, pos, hidden)
            capture.rows += rows.numel()
            if capture.rows >= prompt.prompt_len and not capture.sent:  # the prompt's last rows: out in-band
                capture.sent = True
                self._outbox[req_id] = {"thinker_hidden": capture.to_builtins()}

    @staticmethod
    def _capture_hidden(capture: Capture, rows: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor) -> None:
        if capture.multimodal_positions.numel() == 0:
            return
        if capture.hidden is None:
            capture.hidden = torch.zeros(capture.multimodal_positions.numel(), hidden.shape[-1], dtype=torch.float32)
        slot = torch.searchsorted(capture.multimodal_positions, pos.cpu())
        slot = slot.clamp_max(capture.multimodal_positions.numel() - 1)
        hit = capture.multimodal_positions[slot] == pos.cpu()
        capture.hidden[slot[hit]] = hidden[rows.cpu()[hit]].to("cpu", torch.float32)

    def take(self, request_id: str, keep: bool = False) -> dict[str, Any] | None:
        """The capture of a running request by its external id (vLLM appends `-` and 8 characters to it); `keep`
        leaves it in place (its request still runs)."""
        for key in list(self._captures):
            if key == request_id or (len(key) == len(request_id) + 9 and key.startswith(request_id + "-")):
                return (self._captures[key] if keep else self._captures.pop(key)).to_builtins()
        return None


class ThinkerHiddenStatesExtension:
    """Worker extension (`worker_extension_cls`): the capture of a running request, for the output collector
    when vLLM merged away the output that carried it."""

    def take_thinker_hidden(self, request_ids: list[str], keep: bool = False) -> dict[str, dict[str, Any] | None]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        return {rid: connector.take(rid, keep) for rid in request_ids}
