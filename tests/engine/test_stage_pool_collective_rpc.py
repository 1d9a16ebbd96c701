"""StagePool control RPC: AR control methods go to vLLM's `<method>_async` helpers (with timeout); others
and every diffusion method go through `collective_rpc_async`; unattached replicas answer a `StageRpcError`.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from vllm_omni.config.stage_config import VllmOmniARStageConfig
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.messages import StageRpcError
from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClient
from vllm_omni.engine.stage_pool import StagePool


class Client:
    def __init__(self, stage_type: str) -> None:
        self.kind = StageKind(stage_type)
        self.calls: list = []
        self.is_dead = False
        self.is_restarting = False

    async def pause_scheduler_async(self, **kwargs):
        self.calls.append(("pause_scheduler_async", kwargs))
        return "paused"

    async def reset_prefix_cache_async(self, *args, **kwargs):
        self.calls.append(("reset_prefix_cache_async", args, kwargs))
        return "helper"

    async def sleep_async(self, *args, **kwargs):
        await asyncio.sleep(5)
        return "slept"

    async def collective_rpc_async(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc_async", method, timeout, args, kwargs))
        return "rpc"


async def test_ar_control_method_uses_engine_core_helper():
    client = Client("llm")
    pool = StagePool(0, [client])
    assert await pool.collective_rpc(0, "pause_scheduler", args=None, kwargs={"mode": "abort"}) == "paused"
    assert client.calls == [("pause_scheduler_async", {"mode": "abort"})]


async def test_other_method_goes_through_collective_rpc():
    client = Client("llm")
    pool = StagePool(0, [client])
    assert await pool.collective_rpc(0, "reset_prefix_cache", timeout=1.5, args=("x",), kwargs={"k": 1}) == "rpc"
    assert client.calls == [("collective_rpc_async", "reset_prefix_cache", 1.5, ("x",), {"k": 1})]


async def test_control_helper_honours_timeout():
    pool = StagePool(0, [Client("llm")])
    result = await pool.collective_rpc(0, "sleep", timeout=0.01)
    assert isinstance(result, StageRpcError) and result.reason == "timeout" and "timed out" in result.error


async def test_diffusion_never_takes_engine_core_shortcut():
    client = Client("diffusion")
    pool = StagePool(0, [client])
    assert await pool.collective_rpc(0, "pause_scheduler", kwargs={"mode": "abort"}) == "rpc"
    assert client.calls[0][:2] == ("collective_rpc_async", "pause_scheduler")


async def test_unattached_replica():
    pool = StagePool(3, [Client("llm"), None], StageKind.AR)
    assert await pool.collective_rpc(1, "sleep") == StageRpcError(
        stage_id=3, replica_id=1, method="sleep", reason="not_attached", error="stage 3 replica 1 is not attached")


async def test_dispatch_prefers_least_loaded_live_replica():
    a, b = Client("llm"), Client("llm")
    pool = StagePool(0, [a, b])
    pool._load = {0: 3, 1: 1}
    assert await pool._pick_replica() == 1
    b.is_dead = True
    assert await pool._pick_replica() == 0


async def test_engine_core_utility_keywords_go_to_their_positions():
    """EngineCore utilities take positional arguments: keywords are bound by the method's signature, not passed
    in dict order (reset_connector=True used to land in reset_running_requests)."""
    calls = []

    class Core:
        async def call_utility_async(self, method, *args):
            calls.append((method, args))
            return True

    client = StageEngineCoreClient(VllmOmniARStageConfig(stage_id=0, model="m"))
    client.llm = SimpleNamespace(engine_core=Core())
    await client.collective_rpc_async("reset_prefix_cache", kwargs={"reset_connector": True})
    await client.collective_rpc_async("reset_prefix_cache", args=(True,))
    assert calls == [("reset_prefix_cache", (False, True)), ("reset_prefix_cache", (True,))]
    with pytest.raises(TypeError):
        await client.collective_rpc_async("reset_prefix_cache", kwargs={"bogus": 1})
