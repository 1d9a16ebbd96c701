"""Base of the Qwen3-Omni stages' KV connectors, which move no KV, and the scheduler that returns their stage data
in-band with the stage's outputs.

vLLM's model interface tells a forward nothing about which request owns which rows. Its KV-connector plugin
interface does carry per-step, per-request metadata from the scheduler to the worker, and a KV block belongs to
one request, so a connector that sends each request's block ids lets the model map rows to requests by their KV
slot. The connectors here use only that: every KV-transfer hook of `KVConnectorBase_V1` is a no-op.

The way back is the same interface: what a forward produced per request besides tokens (the talker's codec frames,
the thinker's prompt capture) goes to the scheduler with the step's `ModelRunnerOutput` (the worker connector's
`build_connector_worker_meta`, read by the scheduler connector's `update_connector_output`), and
`StageDataScheduler` puts it on the step's `EngineCoreOutput` as `kv_transfer_params[STAGE_DATA_KEY]`, the
per-request dict vLLM carries to the client's `RequestOutput`. No RPC, no poll: one outputs message per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorWorkerMetadata
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_omni.catalog.edges import STAGE_DATA_KEY


def slot_connector_engine_kwargs(connector: str, module: str, extension: str, *,
                                 async_scheduling: bool) -> dict[str, Any]:
    """vLLM engine arguments that load `module.connector` as the stage's KV connector, `module.extension` as its
    worker extension (RPCs for direct callers: tests, benchmarks) and the scheduler that returns the connector's
    stage data in-band."""
    scheduler = AsyncStageDataScheduler if async_scheduling else StageDataScheduler
    return {"kv_transfer_config": {"kv_connector": connector, "kv_connector_module_path": module,
                                   "kv_role": "kv_both"},
            "worker_extension_cls": f"{module}.{extension}", "async_scheduling": async_scheduling,
            "scheduler_cls": f"{scheduler.__module__}.{scheduler.__qualname__}"}


@dataclass
class StageDataWorkerMetadata(KVConnectorWorkerMetadata):
    """What one step's forward produced per request (request id -> data); every rank computes the same."""

    data: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, StageDataWorkerMetadata):
            self.data = {**other.data, **self.data}
        return self


class SlotConnector(KVConnectorBase_V1):
    """No external KV is matched, loaded or saved; subclasses build and read the step metadata, and say what a
    request's stage data is (`received`, `stage_data`)."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._outbox: dict[str, dict[str, Any]] = {}  # worker side: this step's data, per request
        self._closing: set[str] = set()  # scheduler side: finished, their data goes out with their last output

    # ---- worker side: the step's data out -------------------------------------------------------------------
    def build_connector_worker_meta(self) -> StageDataWorkerMetadata | None:
        if not self._outbox:
            return None
        outbox, self._outbox = self._outbox, {}
        return StageDataWorkerMetadata(outbox)

    # ---- scheduler side: into the outputs ----------------------------------------------------------------------
    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, StageDataWorkerMetadata):
            for req_id, data in meta.data.items():
                self.received(req_id, data)

    def received(self, req_id: str, data: dict[str, Any]) -> None:
        """A step's data of a request (worker side's `_outbox` entry)."""
        raise NotImplementedError

    def stage_data(self, req_id: str, finished: bool) -> dict[str, Any] | None:
        """What this step's output of the request carries (None: nothing); `finished`: its last output."""
        raise NotImplementedError

    def forget(self, req_id: str) -> None:
        """Drop the scheduler-side state of a finished request."""
        raise NotImplementedError

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._closing.add(request.request_id)
        return False, None

    def attach(self, outputs) -> None:
        """Put each output's stage data on it; then forget finished requests (aborted ones have no output)."""
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                data = self.stage_data(out.request_id, out.request_id in self._closing)
                if data:
                    out.kv_transfer_params = {**(out.kv_transfer_params or {}), STAGE_DATA_KEY: data}
        for req_id in self._closing:
            self.forget(req_id)
        self._closing.clear()

    # ---- no KV moves -----------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


class _StageDataOutputs:
    """`update_from_output` of vLLM's scheduler, then the connector's stage data on the step's outputs (the
    connector has this step's worker data by then: vLLM hands it over at the end of `update_from_output`)."""

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        connector = self.get_kv_connector()
        if isinstance(connector, SlotConnector):
            connector.attach(outputs)
        return outputs


class StageDataScheduler(_StageDataOutputs, Scheduler):
    pass


class AsyncStageDataScheduler(_StageDataOutputs, AsyncScheduler):
    pass
