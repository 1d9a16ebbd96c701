"""Orchestrator contracts: routing stage i -> i+1 through stage-input processors and connectors, ordered
final outputs, abort (in the background and awaited), cleanup failures, and death of a stage. The Orchestrator
runs on the test's loop, as on the caller's loop in the engine.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.fakes import FakeStageClient
from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_config import VllmOmniARStageConfig
from vllm_omni.engine.orchestrator import Orchestrator
from vllm_omni.engine.stage_pool import StagePool
from vllm_omni.errors import EngineDeadError, OmniClientError, OmniError


def two_stage_config(connector: str = "inproc") -> VllmOmniConfig:
    return VllmOmniConfig(
        model="m", model_path="m", pipeline_name="two",
        stages=[VllmOmniARStageConfig(stage_id=0, model="m"),
                VllmOmniARStageConfig(stage_id=1, model="m", inputs=[0], input_processor="text_to_prompt",
                                      final_output=True)],
        connectors={"0->1": {"name": connector, "shm_threshold_bytes": 0}})


def chain_config(n: int) -> VllmOmniConfig:
    """`n` text stages in a row, the last one final."""
    return VllmOmniConfig(model="m", model_path="m", pipeline_name=f"chain-{n}", stages=[
        VllmOmniARStageConfig(stage_id=i, model="m", inputs=[i - 1] if i else [],
                              input_processor="text_to_prompt" if i else None, final_output=i == n - 1)
        for i in range(n)])


class Harness:
    """The Orchestrator on the test's loop; every request's outputs (and errors) land in one queue."""

    def __init__(self, clients: list[FakeStageClient], config: VllmOmniConfig | None = None,
                 stage_modalities: list[str] | None = None) -> None:
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.clients = clients
        pools = [StagePool(c.stage_id, [c], c.kind) for c in clients]
        self.orch = Orchestrator(pools, config or chain_config(len(clients)),
                                 stage_modalities or ["text"] * len(clients))
        self.orch.start_monitor()

    def add(self, request_id: str, prompt, params: list, output_modalities: list[str] | None = None) -> None:
        self.orch.add_request(request_id, prompt, params, lambda item: self.outputs.put_nowait((request_id, item)),
                              output_modalities)

    async def next_output(self, timeout: float = 5.0):
        return (await self.next_item(timeout))[1]

    async def next_item(self, timeout: float = 5.0):
        try:
            return await asyncio.wait_for(self.outputs.get(), timeout)
        except TimeoutError:
            raise TimeoutError("no output") from None

    async def close(self) -> None:
        self.orch.close()
        await asyncio.sleep(0)


@pytest.mark.parametrize("connector", ["inproc", "shm"])
async def test_two_stages_route_text_and_stream_only_final_stage(connector):
    h = Harness([FakeStageClient(0, final_output=False), FakeStageClient(1, chunks=3)], two_stage_config(connector))
    h.add("r1", "hello", [None, None])
    outs = [await h.next_output() for _ in range(3)]
    assert [o.finished for o in outs] == [False, False, True]
    assert all(o.stage_id == 1 for o in outs)
    assert outs[-1].text == "hello|s0|s1"  # stage 1 got stage 0's text through the connector
    assert h.clients[1].add_request_calls == [("r1", "hello|s0")]
    assert {"stage0", "stage1", "e2e"} <= set(outs[-1].stage_durations)
    assert "r1" not in h.orch.request_states and len(h.orch.graph.connectors[(0, 1)]) == 0
    await h.close()


async def test_requested_modalities_decide_how_far_a_request_runs():
    """Text and audio both final (Qwen3-Omni's shape): a text-only request never reaches the audio stage."""
    config = two_stage_config("shm")
    config.stages[0].final_output = True
    h = Harness([FakeStageClient(0), FakeStageClient(1)], config, stage_modalities=["text", "audio"])
    h.add("t", "hi", [None, None], ["text"])
    out = await h.next_output()
    assert (out.stage_id, out.finished, out.text) == (0, True, "hi|s0")
    assert h.clients[1].add_request_calls == [] and len(h.orch.graph.connectors[(0, 1)]) == 0
    h.add("a", "hi", [None, None], ["audio"])
    outs = [await h.next_output() for _ in range(2)]
    assert [(o.stage_id, o.finished) for o in outs] == [(0, False), (1, True)]
    h.add("v", "hi", [None, None], ["video"])
    err = await h.next_output()
    assert isinstance(err, OmniClientError) and err.status_code == 400 and err.param == "modalities"
    assert "['audio', 'text']" in str(err) and h.clients[0].add_request_calls[-1][0] == "a"
    await h.close()


async def test_outputs_of_concurrent_requests_stay_per_request():
    h = Harness([FakeStageClient(0, delay=0.05)])
    for i in range(5):
        h.add(f"r{i}", f"p{i}", [None])
    outs = {o.request_id: o for o in [await h.next_output() for _ in range(5)]}
    assert {rid: o.text for rid, o in outs.items()} == {f"r{i}": f"p{i}|s0" for i in range(5)}
    await h.close()


async def test_wrong_number_of_sampling_params_is_a_client_error():
    h = Harness([FakeStageClient(0, final_output=False), FakeStageClient(1)], two_stage_config())
    h.add("r", "x", [None])
    err = await h.next_output()
    assert isinstance(err, OmniClientError) and err.status_code == 400 and "sampling_params_list" in str(err)
    await h.close()


async def test_background_abort_frees_only_the_active_stage():
    h = Harness([FakeStageClient(0, final_output=False, delay=10), FakeStageClient(1)], two_stage_config())
    h.add("req-abort", "x", [None, None])
    await asyncio.sleep(0.05)
    h.orch.abort_soon(["req-abort"])
    await asyncio.sleep(0.05)
    assert h.clients[0].abort_calls == [["req-abort"]]
    assert h.clients[1].abort_calls == []
    assert "req-abort" not in h.orch.request_states
    assert h.outputs.empty()  # an aborted request ends without an output or an error
    await h.close()


async def test_awaited_abort_returns_after_stage_abort():
    h = Harness([FakeStageClient(0, delay=10)])
    h.add("r", "x", [None])
    await asyncio.sleep(0.05)
    await asyncio.wait_for(h.orch.abort(["r"]), 5)
    assert h.clients[0].abort_calls == [["r"]] and "r" not in h.orch.request_states
    await h.close()


async def test_cleanup_failure_is_raised_to_the_awaiting_caller_and_logged_in_the_background(monkeypatch, caplog):
    h = Harness([FakeStageClient(0)])

    async def explode(*args, **kwargs):
        raise RuntimeError("cleanup exploded")

    monkeypatch.setattr(h.orch, "_cleanup_request_ids", explode)
    with pytest.raises(RuntimeError, match="cleanup exploded"):
        await h.orch.abort(["x"])
    h.orch.abort_soon(["x"])
    await asyncio.sleep(0.01)
    assert "Abort failed for request(s) ['x']" in caplog.text
    await h.close()


async def test_stage_failure_fails_only_that_request():
    from vllm_omni.errors import OmniClientError

    bad = FakeStageClient(0, fail_with=OmniClientError("prompt too long", param="prompt"))
    h = Harness([bad])
    h.add("r", "x", [None])
    rid, err = await h.next_item()
    assert isinstance(err, OmniClientError) and rid == "r" and err.status_code == 400 and err.param == "prompt"
    assert h.orch.dead_error is None
    await h.close()


async def test_dead_stage_fails_inflight_requests_and_marks_engine_dead():
    client = FakeStageClient(0, delay=30)
    h = Harness([client])
    h.add("r", "x", [None])
    await asyncio.sleep(0.05)
    client.dead = True
    rid, err = await h.next_item(timeout=3)
    assert isinstance(err, EngineDeadError) and rid == "r" and h.orch.dead_error is not None
    h.add("late", "x", [None])
    rid, late = await h.next_item()
    assert rid == "late" and isinstance(late, OmniError) and late.status_code == 503
    await h.close()


async def test_collective_rpc_reaches_every_replica_of_selected_stages():
    h = Harness([FakeStageClient(0, final_output=False), FakeStageClient(1)], two_stage_config())
    results = await h.orch.collective_rpc("ping", args=(1,), stage_ids=[1])
    assert results == {1: [{"method": "ping", "stage": 1}]}
    assert h.clients[0].rpc_calls == [] and h.clients[1].rpc_calls == [("ping", (1,), None)]
    await h.close()
