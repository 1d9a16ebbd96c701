"""InlineStageDiffusionClient against a stand-in engine that honours contract 3 (submit/abort/collective_rpc/
failure callback/close): params are cloned per request, shutdown is idempotent and closes the engine first.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from vllm_omni.config.stage_config import VllmOmniDiffusionStageConfig
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.inline_stage_diffusion_client import InlineStageDiffusionClient
from vllm_omni.errors import EngineDeadError, OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams


class Engine:
    output_modality = "image"
    prompt_bound = None

    def __init__(self) -> None:
        self.submitted = []
        self.callbacks = []
        self.events: list[str] = []
        self.is_dead = False
        self.result = DiffusionOutput(output=["img"], stage_durations={"denoise": 0.5}, peak_memory_mb=12.0)

    def register_failure_callback(self, fn):
        self.callbacks.append(fn)

    def submit(self, request, on_partial=None):
        self.submitted.append(request)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(self.result)
        return fut

    def abort(self, ids):
        self.events.append(f"abort:{ids}")

    def wait_stopped(self, ids, timeout):
        self.events.append(f"wait_stopped:{ids}")
        return True

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
        return [f"{method}{args}"]

    def close(self, timeout=20.0):
        self.events.append("close")


def make(engine):
    return InlineStageDiffusionClient(VllmOmniDiffusionStageConfig(stage_id=0, model="m", final_output=True),
                                      engine=engine)


async def test_params_cloned_per_request_and_output_shape():
    engine = Engine()
    client = make(engine)
    shared = OmniDiffusionSamplingParams(num_inference_steps=2)
    outs = [o async for o in client.generate("a", "cat", shared)] + [o async for o in client.generate("b", "dog",
                                                                                                     shared)]
    p1, p2 = (r.sampling_params for r in engine.submitted)
    assert p1 is not p2 and p1 is not shared and shared.guidance_scale is None
    assert outs[0].images == ["img"] and outs[0].final_output_type == "image" and outs[0].peak_memory_mb == 12.0
    assert outs[0].stage_durations["diffusion.denoise"] == 0.5 and "diffusion" in outs[0].stage_durations
    durations = outs[0].stage_durations
    assert durations["stage-0-diffusion.denoise"] == 0.5 and "stage-0-diffusion" in durations  # kept per stage
    assert len(engine.callbacks) == 1
    assert await client.collective_rpc_async("sleep", args=(1,)) == ["sleep(1,)"]
    client.shutdown()


async def test_request_error_keeps_status():
    engine = Engine()
    engine.result = DiffusionOutput(error="height must be a multiple of 16", error_status_code=400)
    client = make(engine)
    with pytest.raises(OmniClientError, match="multiple of 16"):
        [o async for o in client.generate("a", "cat", OmniDiffusionSamplingParams())]
    client.shutdown()


async def test_failure_callback_marks_dead():
    engine = Engine()
    client = make(engine)
    engine.callbacks[0]()
    assert client.is_dead
    with pytest.raises(EngineDeadError):
        await client.add_request_async("a", "cat", OmniDiffusionSamplingParams())
    client.shutdown()


async def test_abort_returns_once_the_workers_stopped():
    engine = Engine()
    await make(engine).abort(["r1"])
    assert engine.events == ["abort:['r1']", "wait_stopped:['r1']"]


def test_shutdown_idempotent_engine_closed_before_executor():
    engine = Engine()
    client = make(engine)
    client._shutting_down = True  # the orchestrator may pre-mark shutdown
    original = client._executor.shutdown

    def executor_shutdown(wait=True, cancel_futures=False):
        engine.events.append(f"executor:{wait}:{cancel_futures}")
        original(wait=wait, cancel_futures=cancel_futures)

    client._executor.shutdown = executor_shutdown
    threads = [threading.Thread(target=client.shutdown) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert engine.events == ["close", "executor:True:True"] and client._shutdown_complete


def test_a_start_given_up_closes_the_engine_once_it_is_built(monkeypatch):
    """Why: stages start side by side and the first failure cancels the others; the diffusion engine's
    constructor cannot be interrupted, so the engine it builds must not be left running (with its workers)."""
    import asyncio

    import vllm_omni.diffusion.diffusion_engine as diffusion_engine

    release, built = threading.Event(), []

    class SlowEngine(Engine):
        executor = None

        def __init__(self, od_config) -> None:
            super().__init__()
            release.wait(10)
            built.append(self)

    monkeypatch.setattr(diffusion_engine, "DiffusionEngine", SlowEngine)
    monkeypatch.setattr(VllmOmniDiffusionStageConfig, "make_od_config", lambda self: _OdConfig())
    client = InlineStageDiffusionClient(VllmOmniDiffusionStageConfig(stage_id=0, model="m", final_output=True))

    async def give_up():
        start = asyncio.ensure_future(client.start())
        await asyncio.sleep(0.05)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start

    asyncio.run(give_up())
    release.set()
    client._executor.shutdown(wait=True)
    assert len(built) == 1 and built[0].events == ["close"]
    assert client._engine is None


class _OdConfig:
    class parallel_config:
        world_size = 1
