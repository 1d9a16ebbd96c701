"""Orchestrator contracts: routing stage i -> i+1 through stage-input processors and connectors, ordered
final outputs, abort (fire-and-forget and acknowledged), cleanup failures, and death of a stage.
"""

from __future__ import annotations

import asyncio
import queue

import pytest

from tests.engine.fakes import FakeStageClient
from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_config import VllmOmniARStageConfig
from vllm_omni.engine.messages import (
    AbortRequestMessage,
    AbortResultMessage,
    AddRequestMessage,
    CollectiveRPCRequestMessage,
    CollectiveRPCResultMessage,
    ErrorMessage,
    ShutdownMessage,
)
from vllm_omni.engine.orchestrator import Orchestrator
from vllm_omni.engine.stage_pool import StagePool


def two_stage_config(connector: str = "inproc") -> VllmOmniConfig:
    return VllmOmniConfig(
        model="m", model_path="m", pipeline_name="two",
        stages=[VllmOmniARStageConfig(stage_id=0, model="m"),
                VllmOmniARStageConfig(stage_id=1, model="m", inputs=[0], input_processor="text_to_prompt",
                                      final_output=True)],
        connectors={"0->1": {"name": connector, "shm_threshold_bytes": 0}})


class Harness:
    def __init__(self, clients: list[FakeStageClient], config: VllmOmniConfig | None,
                 stage_modalities: list[str] | None = None) -> None:
        self.requests: asyncio.Queue = asyncio.Queue()
        self.outputs: queue.Queue = queue.Queue()
        self.rpc: queue.Queue = queue.Queue()
        self.clients = clients
        pools = [StagePool(c.stage_id, [c], c.kind) for c in clients]
        self.orch = Orchestrator(self.requests, self.outputs, self.rpc, pools, config, stage_modalities)
        self.task = asyncio.create_task(self.orch.run())

    async def next_output(self, timeout: float = 5.0):
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                return self.outputs.get_nowait()
            except queue.Empty:
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError("no output") from None
                await asyncio.sleep(0.005)

    async def next_rpc(self, timeout: float = 5.0):
        deadline = asyncio.get_running_loop().time() + timeout
        while self.rpc.empty():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("no rpc result")
            await asyncio.sleep(0.005)
        return self.rpc.get_nowait()

    async def close(self) -> None:
        await self.requests.put(ShutdownMessage())
        await asyncio.wait_for(self.task, 5)


@pytest.mark.parametrize("connector", ["inproc", "shm"])
async def test_two_stages_route_text_and_stream_only_final_stage(connector):
    h = Harness([FakeStageClient(0, final_output=False), FakeStageClient(1, chunks=3)], two_stage_config(connector))
    await h.requests.put(AddRequestMessage(request_id="r1", prompt="hello", sampling_params_list=[None, None]))
    outs = [await h.next_output() for _ in range(3)]
    assert [o.finished for o in outs] == [False, False, True]
    assert all(o.stage_id == 1 for o in outs)
    assert outs[-1].text == "hello|s0|s1"  # stage 1 got stage 0's text through the connector
    assert h.clients[1].add_request_calls == [("r1", "hello|s0")]
    assert {"stage0", "stage1", "e2e"} <= set(outs[-1].stage_durations)
    assert "r1" not in h.orch.request_states and len(h.orch.connectors[(0, 1)]) == 0
    await h.close()


async def test_requested_modalities_decide_how_far_a_request_runs():
    """Text and audio both final (Qwen3-Omni's shape): a text-only request never reaches the audio stage."""
    config = two_stage_config("shm")
    config.stages[0].final_output = True
    h = Harness([FakeStageClient(0), FakeStageClient(1)], config, stage_modalities=["text", "audio"])
    await h.requests.put(AddRequestMessage(request_id="t", prompt="hi", sampling_params_list=[None, None],
                                           output_modalities=["text"]))
    out = await h.next_output()
    assert (out.stage_id, out.finished, out.text) == (0, True, "hi|s0")
    assert h.clients[1].add_request_calls == [] and len(h.orch.connectors[(0, 1)]) == 0
    await h.requests.put(AddRequestMessage(request_id="a", prompt="hi", sampling_params_list=[None, None],
                                           output_modalities=["audio"]))
    outs = [await h.next_output() for _ in range(2)]
    assert [(o.stage_id, o.finished) for o in outs] == [(0, False), (1, True)]
    await h.requests.put(AddRequestMessage(request_id="v", prompt="hi", sampling_params_list=[None, None],
                                           output_modalities=["video"]))
    err = await h.next_output()
    assert isinstance(err, ErrorMessage) and err.status_code == 400 and err.param == "modalities"
    assert "['audio', 'text']" in err.error and h.clients[0].add_request_calls[-1][0] == "a"
    await h.close()


async def test_outputs_of_concurrent_requests_stay_per_request():
    h = Harness([FakeStageClient(0, delay=0.05)], None)
    for i in range(5):
        await h.requests.put(AddRequestMessage(request_id=f"r{i}", prompt=f"p{i}", sampling_params_list=[None]))
    outs = {o.request_id: o for o in [await h.next_output() for _ in range(5)]}
    assert {rid: o.text for rid, o in outs.items()} == {f"r{i}": f"p{i}|s0" for i in range(5)}
    await h.close()


async def test_wrong_number_of_sampling_params_is_a_client_error():
    h = Harness([FakeStageClient(0, final_output=False), FakeStageClient(1)], two_stage_config())
    await h.requests.put(AddRequestMessage(request_id="r", prompt="x", sampling_params_list=[None]))
    err = await h.next_output()
    assert isinstance(err, ErrorMessage) and err.status_code == 400 and "sampling_params_list" in err.error
    await h.close()


async def test_fire_and_forget_abort_frees_only_the_active_stage():
    h = Harness([FakeStageClient(0, final_output=False, delay=10), FakeStageClient(1)], two_stage_config())
    await h.requests.put(AddRequestMessage(request_id="req-abort", prompt="x", sampling_params_list=[None, None]))
    await asyncio.sleep(0.05)
    await h.requests.put(AbortRequestMessage(request_ids=["req-abort"]))
    await asyncio.sleep(0.05)
    assert h.clients[0].abort_calls == [["req-abort"]]
    assert h.clients[1].abort_calls == []
    assert "req-abort" not in h.orch.request_states
    assert h.rpc.empty()
    await h.close()


async def test_acknowledged_abort_emits_result_after_stage_abort():
    h = Harness([FakeStageClient(0, delay=10)], None)
    await h.requests.put(AddRequestMessage(request_id="r", prompt="x", sampling_params_list=[None]))
    await asyncio.sleep(0.05)
    await h.requests.put(AbortRequestMessage(request_ids=["r"], rpc_id="abort-1"))
    result = await h.next_rpc()
    assert result == AbortResultMessage(rpc_id="abort-1", success=True, error=None)
    assert h.clients[0].abort_calls == [["r"]] and "r" not in h.orch.request_states
    await h.close()


async def test_cleanup_failure_is_reported_with_rpc_id_and_raised_without(monkeypatch):
    h = Harness([FakeStageClient(0)], None)

    async def explode(*args, **kwargs):
        raise RuntimeError("cleanup exploded")

    monkeypatch.setattr(h.orch, "_cleanup_request_ids", explode)
    await h.orch._handle_abort(AbortRequestMessage(request_ids=["x"], rpc_id="a2"))
    result = await h.next_rpc()
    assert not result.success and "cleanup exploded" in result.error
    with pytest.raises(RuntimeError, match="cleanup exploded"):
        await h.orch._handle_abort(AbortRequestMessage(request_ids=["x"]))
    await h.close()


async def test_stage_failure_fails_only_that_request():
    from vllm_omni.errors import OmniClientError

    bad = FakeStageClient(0, fail_with=OmniClientError("prompt too long", param="prompt"))
    h = Harness([bad], None)
    await h.requests.put(AddRequestMessage(request_id="r", prompt="x", sampling_params_list=[None]))
    err = await h.next_output()
    assert isinstance(err, ErrorMessage) and err.request_id == "r" and err.status_code == 400 and not err.fatal
    assert h.orch.dead_error is None
    await h.close()


async def test_dead_stage_fails_inflight_requests_and_marks_engine_dead():
    client = FakeStageClient(0, delay=30)
    h = Harness([client], None)
    await h.requests.put(AddRequestMessage(request_id="r", prompt="x", sampling_params_list=[None]))
    await asyncio.sleep(0.05)
    client.dead = True
    err = await h.next_output(timeout=3)
    assert isinstance(err, ErrorMessage) and err.request_id == "r" and err.error_type == "EngineDeadError"
    fatal = await h.next_output()
    assert fatal.fatal and h.orch.dead_error is not None
    await h.requests.put(AddRequestMessage(request_id="late", prompt="x", sampling_params_list=[None]))
    late = await h.next_output()
    assert late.request_id == "late" and late.status_code == 503
    await h.close()


async def test_collective_rpc_reaches_every_replica_of_selected_stages():
    h = Harness([FakeStageClient(0, final_output=False), FakeStageClient(1)], two_stage_config())
    await h.requests.put(CollectiveRPCRequestMessage(rpc_id="c1", method="ping", args=(1,), stage_ids=[1]))
    result = await h.next_rpc()
    assert isinstance(result, CollectiveRPCResultMessage) and result.rpc_correlation_key == ("collective_rpc", "c1")
    assert result.results == {1: [{"method": "ping", "stage": 1}]}
    assert h.clients[0].rpc_calls == [] and h.clients[1].rpc_calls == [("ping", (1,), None)]
    await h.close()
