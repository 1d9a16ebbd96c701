"""Failure handling of the diffusion runtime, with real worker processes.

What it pins: `kill -9` of a worker mid-request fails the caller with EngineDeadError within 10 s, marks the
engine dead and fires the failure callbacks; a new engine starts afterwards; `close()` leaves no worker
process and no shared-memory segment; a pipeline that cannot load fails engine start-up naming the rank
and the worker's error.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
from fake_pipelines import FailingLoadPipeline, FakeBatchPipeline, class_path

from tests.entrypoints.leak_checks import multiprocessing_helper
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.errors import EngineDeadError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP


def make_engine(model_dir, cls=FakeBatchPipeline, **kwargs) -> DiffusionEngine:
    return DiffusionEngine(OmniDiffusionConfig(model=str(model_dir), model_class_name=class_path(cls), **kwargs))


def assert_nothing_left(engine: DiffusionEngine) -> None:
    for proc in engine.executor.processes:
        assert not proc.is_alive()
        assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(engine.executor.shm_prefix)]
    assert not os.path.exists(engine.executor._ipc_dir)


def test_kill9_worker_fails_requests_fast_and_engine_restarts(tmp_path):
    engine = make_engine(tmp_path, max_stage_restarts=0)  # no restart budget: the engine is dead
    died = threading.Event()
    engine.register_failure_callback(died.set)
    running = engine.submit(OmniDiffusionRequest("sleep:60", SP(), "slow"))
    waiting = engine.submit(OmniDiffusionRequest("queued", SP(height=32), "queued"))
    time.sleep(0.5)
    # A segment the worker might have left mid-send: close() must sweep it.
    stray = f"/dev/shm/{engine.executor.shm_prefix}stray"
    open(stray, "wb").close()
    killed_at = time.monotonic()
    os.kill(engine.executor.processes[0].pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        running.result(timeout=10)
    with pytest.raises(EngineDeadError):
        waiting.result(timeout=10)
    assert time.monotonic() - killed_at < 10
    assert died.wait(5) and engine.is_dead
    with pytest.raises(EngineDeadError):
        engine.submit(OmniDiffusionRequest("late", SP(), "late"))
    start = time.monotonic()
    engine.close()
    assert time.monotonic() - start < 20
    assert_nothing_left(engine)

    fresh = make_engine(tmp_path)
    try:
        assert fresh.submit(OmniDiffusionRequest("again", SP(), "again")).result(60).error is None
    finally:
        fresh.close()
    assert_nothing_left(fresh)


def _child_pids() -> set[int]:
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:  # a child may exit (or be a zombie) while we look
            if not multiprocessing_helper(child) and child.status() != psutil.STATUS_ZOMBIE:
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def test_load_failure_names_rank_and_error(tmp_path):
    before = _child_pids()
    with pytest.raises(RuntimeError, match=r"rank 0 failed to start(.|\n)*no weights here"):
        make_engine(tmp_path, FailingLoadPipeline)
    assert _child_pids() - before == set()


_ORPHAN_SCRIPT = """
import sys, time
from fake_pipelines import FakeBatchPipeline, class_path
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
if __name__ == "__main__":
    engine = DiffusionEngine(OmniDiffusionConfig(model=sys.argv[1], model_class_name=class_path(FakeBatchPipeline)))
    print(engine.executor.processes[0].pid, flush=True)
    time.sleep(600)
"""


def test_workers_exit_when_the_engine_process_is_killed(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "engine_proc.py"
    script.write_text(_ORPHAN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
           "VLLM_LOGGING_STREAM": "ext://sys.stderr"}  # stdout carries only the pid; worker logs go to stderr
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        worker_pid = int(proc.stdout.readline())
        assert psutil.pid_exists(worker_pid)
        proc.kill()
        proc.wait(10)
        gone, alive = psutil.wait_procs([psutil.Process(worker_pid)], timeout=10)
        assert not alive, "a diffusion worker outlived its engine process"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
