"""Reliability of the diffusion runtime with real worker processes (only the pipeline is fake).

What it pins: an abort reaches a worker busy inside a forward through the side channel and the request leaves
within a step, so the next request runs at once; in a co-batched forward only the aborted row leaves; a request
or an output that cannot be encoded fails alone and the worker lives on; `kill -9` of a worker fails its request
with a 503 within 1 s, reaps it (no zombie), frees its shm and socket files, and the engine serves again on new
workers, but a worker that dies once the engine is stopping (`begin_shutdown`) is not replaced, nor one whose
death came just before the stop; a busy worker exits within 10 s of a SIGKILL of its engine's process, and so
does (once its imports are done) a worker that was still starting then (a restart the engine's death overtook);
a diffusion core whose API process is killed while its worker loads exits within 10 s, and its worker with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import CancelledError
from pathlib import Path

import psutil
import pytest
from fake_pipelines import FakeStepPipeline, SlowLoadPipeline, class_path
from test_diffusion_engine_failures import assert_nothing_left, make_engine

from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.envs import ENGINE_CORE_FORKS_WORKERS
from vllm_omni.errors import EngineDeadError, StageRestartingError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

FOREVER = 100_000  # steps: about half an hour of FakeStepPipeline


def request(rid: str, steps: int, prompt: str = "x") -> OmniDiffusionRequest:
    return OmniDiffusionRequest(prompt, SP(num_inference_steps=steps, height=16), rid)


def wait_running(engine, n: int = 1, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats()["num_running"] < n:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    time.sleep(0.2)  # well inside the forward now


def process_gone(pid: int) -> bool:
    """Neither running nor a zombie: /proc has no entry once the parent reaped it."""
    try:
        return "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    except (FileNotFoundError, ProcessLookupError):  # reaped, also while we read
        return True


def test_abort_stops_the_running_forward(tmp_path):
    engine = make_engine(tmp_path, FakeStepPipeline)
    try:
        long = engine.submit(request("long", FOREVER))
        wait_running(engine)
        engine.abort(["long"])
        with pytest.raises(CancelledError):
            long.result(timeout=0)  # resolved at once, not when the worker gets round to it
        assert engine.wait_stopped(["long"], timeout=2.0)  # the worker left the forward within a step
        start = time.monotonic()
        short = engine.submit(request("short", 2)).result(timeout=30)
        assert short.error is None and short.extra["steps_run"] == 2
        assert time.monotonic() - start < 2.0
        stats = engine.stats()
        assert stats["num_aborted"] == 1 and stats["num_running"] == 0
    finally:
        engine.close()
    assert_nothing_left(engine)


def test_abort_in_a_cobatched_forward_drops_only_that_row(tmp_path):
    engine = make_engine(tmp_path, FakeStepPipeline, max_num_seqs=2, request_batch_max_wait_ms=500)
    try:
        doomed = engine.submit(request("doomed", 100))  # same steps: requests co-batch only with equal keys
        kept = engine.submit(request("kept", 100))
        wait_running(engine, 2)
        engine.abort(["doomed"])
        out = kept.result(timeout=30)
        assert out.error is None and out.extra == {"batch_size": 2, "steps_run": 100, "rows_left": 1}
        assert doomed.cancelled()
    finally:
        engine.close()


def test_unencodable_request_or_output_fails_alone(tmp_path):
    engine = make_engine(tmp_path, FakeStepPipeline, max_num_seqs=3, request_batch_max_wait_ms=500)
    try:
        pid = engine.executor.processes[0].pid
        futures = [engine.submit(request("surrogate", 1, "\ud800")), engine.submit(request("bad", 1, "bad-output")),
                   engine.submit(request("fine", 1))]
        surrogate, bad, fine = (f.result(timeout=30) for f in futures)
        assert surrogate.error_status_code == 400 and "not valid Unicode" in surrogate.error
        assert bad.error_status_code == 500 and "cannot be sent" in bad.error
        assert fine.error is None and fine.extra["batch_size"] == 2  # the surrogate never reached the worker
        assert engine.submit(request("after", 1)).result(timeout=30).error is None
        assert engine.executor.processes[0].pid == pid and not engine.is_dead
    finally:
        engine.close()


def test_kill9_mid_request_fails_fast_then_the_stage_restarts_but_never_while_stopping(tmp_path):
    engine = make_engine(tmp_path, FakeStepPipeline)
    try:
        running = engine.submit(request("running", FOREVER))
        wait_running(engine)
        old = engine.executor
        queued = engine.submit(request("queued", 2))
        pid = old.processes[0].pid
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(StageRestartingError):
            running.result(timeout=5)
        assert time.monotonic() - killed_at <= 1.0
        assert not engine.is_dead
        deadline = time.monotonic() + 10
        while not (process_gone(pid) and not os.path.exists(old._ipc_dir)):
            assert time.monotonic() < deadline, "dead worker not reaped or its socket files not removed"
            time.sleep(0.1)
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(old.shm_prefix)]
        assert queued.result(timeout=60).error is None  # waited for the new workers
        assert time.monotonic() - killed_at < 60
        assert engine.executor is not old and engine.stats()["num_restarts"] == 1
        assert engine.submit(request("next", 2)).result(timeout=30).error is None

        # Once its owner is stopping (a group's SIGTERM reached the core and the workers), a death is no failure.
        running = engine.submit(request("at-stop", FOREVER))
        wait_running(engine)
        engine.begin_shutdown()
        os.kill(engine.executor.processes[0].pid, signal.SIGTERM)
        with pytest.raises(EngineDeadError):  # not StageRestartingError: nothing comes back
            running.result(timeout=5)
        time.sleep(0.5)  # a restart would have begun by now
        stats = engine.stats()
        assert stats["num_restarts"] == 1 and not stats["is_restarting"] and not stats["is_dead"]
    finally:
        engine.close()
    assert_nothing_left(engine)


def test_restart_budget_spent_means_dead(tmp_path):
    engine = make_engine(tmp_path, FakeStepPipeline, max_stage_restarts=1)
    try:
        for attempt in range(2):
            future = engine.submit(request(f"r{attempt}", FOREVER))
            wait_running(engine, timeout=60)
            os.kill(engine.executor.processes[0].pid, signal.SIGKILL)
            with pytest.raises(StageRestartingError if attempt == 0 else EngineDeadError):
                future.result(timeout=5)
        assert engine.is_dead
        with pytest.raises(EngineDeadError):
            engine.submit(request("late", 1))
    finally:
        engine.close()
    assert_nothing_left(engine)


def test_a_stop_just_after_a_worker_death_starts_no_new_worker(tmp_path):
    """A SIGTERM to the whole process group: the worker dies and the core's loop sees it before the core's signal
    handler ran (`begin_shutdown`, a moment later). Why: the restart began at once, a new worker started and was
    stopped again with the core (9.5 s to exit an idle server)."""
    engine = make_engine(tmp_path, FakeStepPipeline)
    try:
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        running = engine.submit(request("running", FOREVER))
        wait_running(engine)
        os.kill(engine.executor.processes[0].pid, signal.SIGKILL)
        with pytest.raises(StageRestartingError):  # the death was seen: the restart has begun
            running.result(timeout=5)
        engine.begin_shutdown()
        time.sleep(1.5)  # a new worker process would have been spawned by now
        new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
               and p.status() != psutil.STATUS_ZOMBIE]
        assert new == [], [p.cmdline() for p in new]
    finally:
        engine.close()
    assert_nothing_left(engine)


_ORPHAN_SCRIPT = """
import sys, threading, time
sys.path.insert(0, {tests!r})
from fake_pipelines import FakeStepPipeline, SlowLoadPipeline, class_path
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.executor import make_executor
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

engine = DiffusionEngine(OmniDiffusionConfig(model={model!r}, model_class_name={cls!r}))
engine.submit(OmniDiffusionRequest("x", SP(num_inference_steps=100_000), "busy"))
ex = engine.executor
print(ex.processes[0].pid, ex.shm_prefix, ex._ipc_dir, flush=True)
threading.Thread(target=make_executor, args=(engine.od_config,), daemon=True).start()  # as a restart does
time.sleep(600)
"""


def test_workers_exit_when_their_engine_is_killed_even_while_starting(tmp_path):
    script = _ORPHAN_SCRIPT.format(tests=str(Path(__file__).parent), model=str(tmp_path),
                                   cls=class_path(FakeStepPipeline))
    env = {**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stderr"}  # stdout carries only the ids; logs go to stderr
    # The user's spawn, where a starting worker imports for seconds before it can watch anything (our default, the
    # preloaded forkserver, hands a worker its imports done).
    env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    env.pop(ENGINE_CORE_FORKS_WORKERS, None)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True,
                            env=env)
    starting = None
    try:
        pid, shm_prefix, ipc_dir = proc.stdout.readline().split()
        busy = int(pid)
        deadline = time.monotonic() + 60
        while starting is None:  # the new worker's process, still importing what its spec needs
            assert time.monotonic() < deadline, "the second executor started no worker"
            starting = next((p for p in psutil.Process(proc.pid).children()
                             if p.pid != busy and "spawn_main" in " ".join(p.cmdline())), None)
            time.sleep(0.05)
        # Once it runs its imports it has read what the engine sent it (a kill before would fail its start), and
        # its watch starts only after them (torch: seconds of CPU).
        while sum(starting.cpu_times()[:2]) < 0.5:
            time.sleep(0.05)
        proc.kill()
        proc.wait(10)
        killed_at = time.monotonic()
        while not process_gone(busy):  # re-parented: init reaps it once it exits
            assert time.monotonic() - killed_at < 10, "the busy worker outlived its engine"
            time.sleep(0.1)
        assert not os.path.exists(ipc_dir)
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(shm_prefix)]
        # Its engine was gone before it could look (a pid watch would watch PID 1): its death pipe is closed. It
        # watches once its imports are done (torch: 5 s of CPU, over 60 s at load average 20); it never exits without.
        while not process_gone(starting.pid):
            assert time.monotonic() - killed_at < 120, "the worker that was starting outlived its engine"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(10)
        if starting is not None and not process_gone(starting.pid):
            starting.kill()


_KILLED_WHILE_LOADING = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from vllm_omni.config.stage_config import VllmOmniDiffusionStageConfig
from vllm_omni.engine.stage_diffusion_client import StageDiffusionClient

config = VllmOmniDiffusionStageConfig(stage_id=0, model={model!r}, final_output=True,
                                      engine_args={{"model_class_name": {cls!r}}})
asyncio.run(StageDiffusionClient(config).start())
"""


def test_a_core_whose_api_process_dies_while_its_worker_loads_exits(tmp_path):
    """Why: the core's busy loop, which watches the API process, runs only once the engine started, and a large
    model loads for minutes; the core (and through its death pipe its worker) must not outlive a killed API
    process by that long."""
    script = _KILLED_WHILE_LOADING.format(tests=str(Path(__file__).parent), model=str(tmp_path),
                                          cls=class_path(SlowLoadPipeline))
    api = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = []
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "loading").exists():  # the worker is inside the 10-minute load
            assert time.monotonic() < deadline and api.poll() is None, "the worker never began to load"
            time.sleep(0.1)
        started = psutil.Process(api.pid).children(recursive=True)  # the core and its worker
        assert started
        api.kill()
        api.wait(10)
        killed_at = time.monotonic()
        alive = started
        while alive := [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
            assert time.monotonic() - killed_at < 10, f"outlived the API process: {[p.cmdline() for p in alive]}"
            time.sleep(0.1)
    finally:
        api.kill()
        for proc in started:
            if proc.is_running():
                proc.kill()
