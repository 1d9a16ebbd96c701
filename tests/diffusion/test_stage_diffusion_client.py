"""The diffusion stage client against a real diffusion core process (fake pipeline, real workers).

The core is a prestarted one (`diffusion/core/prestart.py`, what `vllm serve` hands a diffusers checkpoint's
stage): forked before the stage exists and adopted by it; every other engine test runs a spawned core.

What it pins: params are cloned per request and the output has the stage's shape and timings; a request's own
error keeps its status; an abort returns once the workers left the request; a utility call reaches every rank,
and one past its timeout is answered by the core while the workers are busy;
the API process runs no thread for the stage; the workers are forked from the core; the core's death marks the
stage dead at once (seen through its sentinel on the loop) and new requests fail fast; shutdown is idempotent and
leaves no process behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from fake_pipelines import FakeStepPipeline, class_path

from vllm_omni.config.stage_config import VllmOmniDiffusionStageConfig
from vllm_omni.diffusion.core.prestart import PrestartedCore
from vllm_omni.engine.stage_diffusion_client import StageDiffusionClient
from vllm_omni.errors import EngineDeadError, OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
async def client(tmp_path_factory):
    config = VllmOmniDiffusionStageConfig(
        stage_id=0,
        model=str(tmp_path_factory.mktemp("fake")),
        final_output=True,
        engine_args={"model_class_name": class_path(FakeStepPipeline), "max_num_seqs": 2},
    )
    threads_before = {t.ident for t in threading.enumerate()}
    prestarted = PrestartedCore()
    stage = StageDiffusionClient(config, prestarted_core=prestarted)
    await stage.start()
    stage.on_loop()
    stage.prestarted_pid = prestarted.process.pid
    stage.threads_added = [t.name for t in threading.enumerate() if t.ident not in threads_before]
    yield stage
    stage.shutdown()


async def test_params_cloned_and_output_shape(client):
    shared = SP(num_inference_steps=2, height=8)
    outs = [o async for o in client.generate("a", "cat", shared)] + [
        o async for o in client.generate("b", "dog", shared)
    ]
    assert shared.guidance_scale is None and not shared.stream_partial_outputs
    assert [o.finished for o in outs] == [True, True] and outs[0].final_output_type == "image"
    assert len(outs[0].images) == 1 and outs[0].images[0].size == (8, 8)
    durations = outs[0].stage_durations
    assert {"diffusion", "diffusion.denoise", "diffusion.queue", "stage-0-diffusion.denoise"} <= set(durations)
    assert client.threads_added == []  # the stage's reading happens on this loop


async def test_request_error_keeps_status(client):
    with pytest.raises(OmniClientError, match="refused") as info:
        [o async for o in client.generate("f", "fail", SP(num_inference_steps=1))]
    assert info.value.status_code == 422
    (out,) = [o async for o in client.generate("after", "cat", SP(num_inference_steps=1))]
    assert out.finished


async def test_abort_returns_once_the_workers_stopped(client):
    async def run() -> list:
        return [o async for o in client.generate("long", "cat", SP(num_inference_steps=500))]

    task = asyncio.create_task(run())
    await asyncio.sleep(1.0)  # on the workers by now (one step is 20 ms)
    start = time.monotonic()
    await client.abort(["long"])
    assert time.monotonic() - start < 3.0
    with pytest.raises(asyncio.CancelledError):
        await task
    (out,) = [o async for o in client.generate("next", "cat", SP(num_inference_steps=1))]
    assert out.finished


async def test_collective_rpc_reaches_every_rank(client):
    (info,) = await client.collective_rpc_async("ping", timeout=30)
    assert info["rank"] == 0 and info["pid"] != os.getpid()


async def test_a_utility_call_past_its_timeout_is_answered_by_the_core(client):
    """Why: the core's busy loop handles utility calls without waiting in them (no utility thread): a worker busy
    inside a forward answers nothing, so the core's own deadline must answer the call, while the loop goes on
    serving (the abort below), and the worker's late answer must be dropped, not taken for another call's. After
    the calls the core still runs one thread besides ZeroMQ's (counted from outside: /proc/<pid>/task)."""
    async def run() -> list:
        return [o async for o in client.generate("busy", "cat", SP(num_inference_steps=500))]

    task = asyncio.create_task(run())
    await asyncio.sleep(1.0)  # inside its forward by now
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="no answer from every rank within 0.5 s"):
        await client.collective_rpc_async("ping", timeout=0.5)
    assert time.monotonic() - start < 2.0  # the core's deadline, not the client's (timeout + 5 s)
    await client.abort(["busy"])
    (info,) = await client.collective_rpc_async("ping", timeout=30)
    assert info["rank"] == 0
    with pytest.raises(asyncio.CancelledError):
        await task
    threads = [p.read_text().strip() for p in Path(f"/proc/{client._core.proc.pid}/task").glob("*/comm")]
    assert len([name for name in threads if not name.startswith("ZMQbg/")]) == 1, threads


async def test_the_stage_adopts_the_prestarted_core(client):
    """Why: a spawned core imports torch and vLLM again after the API process did (6-7 s of a 2-core start);
    the prestarted one was forked with them and imported the core's modules before the stage existed."""
    assert client._core.proc.pid == client.prestarted_pid
    assert psutil.Process(client.prestarted_pid).ppid() == os.getpid()
    assert client._core.proc.name == "DiffusionCore-0"


async def test_the_workers_are_forked_from_the_core(client):
    """Why: a spawned worker imports torch and vLLM again in a fresh interpreter (6-12 s of a stage start on
    CPU); forked from the core, which has imported them, it starts with them."""
    (info,) = await client.collective_rpc_async("ping", timeout=30)
    worker, core = psutil.Process(info["pid"]), psutil.Process(client._core.proc.pid)
    assert worker.ppid() == core.pid
    assert worker.cmdline() == core.cmdline()  # the core's interpreter, not a `spawn_main` of its own


async def test_core_death_marks_the_stage_dead(client):
    pid = client._core.proc.pid
    os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        if client.is_dead:
            break
        await asyncio.sleep(0.05)
    assert client.is_dead
    with pytest.raises(EngineDeadError):
        [o async for o in client.generate("late", "cat", SP(num_inference_steps=1))]
    client.shutdown()
    client.shutdown()
    assert not client._core.proc.is_alive()


async def test_a_start_given_up_leaves_no_core(tmp_path):
    """Why: stages start side by side and the first failure cancels the others; a cancelled start must not leave
    the core (and the workers it starts) running."""
    config = VllmOmniDiffusionStageConfig(
        stage_id=1,
        model=str(tmp_path),
        final_output=True,
        engine_args={"model_class_name": class_path(FakeStepPipeline)},
    )
    stage = StageDiffusionClient(config)
    start = asyncio.ensure_future(stage.start())
    for _ in range(1000):
        if stage._core is not None and stage._core.proc is not None:
            break
        await asyncio.sleep(0.01)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    assert not stage._core.proc.is_alive()

