"""The vLLM plugin hook lets an EngineCore fork its workers and leaves every other process's start method alone; a
diffusion core forks its workers under the same condition, only while it runs one thread. An EngineCore that stops
cleanly leaves without the interpreter's teardown; a failed one, or any other process, keeps it."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading

import pytest

from vllm_omni.diffusion.executor.multiproc_executor import _worker_context
from vllm_omni.diffusion.process_start import user_chose_no_start_method
from vllm_omni.envs import ENGINE_CORE_FORKS_WORKERS
from vllm_omni.plugins import register_models

EXIT_PROBE = """
import atexit, multiprocessing, sys


class Cycle:
    def __del__(self):
        print("interpreter teardown ran", flush=True)


def target(how):
    from vllm_omni.plugins import _exit_without_teardown_in_engine_core

    atexit.register(print, "exit handlers ran", flush=True)
    _exit_without_teardown_in_engine_core()
    keep = Cycle()
    keep.me = keep
    globals()["keep"] = keep  # only the teardown's collection frees it
    if how == "fail":
        raise RuntimeError("boom")
    if how == "sigterm":
        raise SystemExit()  # what vLLM's EngineCore raises on SIGTERM


if __name__ == "__main__":
    proc = multiprocessing.get_context("spawn").Process(target=target, args=(sys.argv[1],), name=sys.argv[2])
    proc.start()
    proc.join(60)
    print("exit code", proc.exitcode, flush=True)
"""


@pytest.mark.parametrize(
    ("process_name", "method"),
    [("EngineCore", "fork"), ("EngineCore_DP1", "fork"), ("MainProcess", "spawn"), ("VllmWorker-0", "spawn")],
)
def test_only_an_engine_core_forks_its_workers(monkeypatch, process_name, method):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # what our front end sets for its EngineCores
    monkeypatch.setenv(ENGINE_CORE_FORKS_WORKERS, "1")  # ... when the user chose no start method
    monkeypatch.setattr(multiprocessing.current_process(), "name", process_name)
    register_models()  # what vLLM runs in each process it starts, the EngineCore before its executor
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == method


@pytest.mark.parametrize(("how", "process_name", "teardown", "code"), [
    ("return", "EngineCore_DP0", False, 0), ("sigterm", "EngineCore_DP0", False, 0),
    ("fail", "EngineCore_DP0", True, 1), ("return", "VllmWorker-0", True, 0)])
def test_only_a_cleanly_stopped_engine_core_skips_the_interpreter_teardown(tmp_path, how, process_name, teardown,
                                                                            code):
    script = tmp_path / "probe.py"
    script.write_text(EXIT_PROBE)
    out = subprocess.run([sys.executable, str(script), how, process_name], capture_output=True, text=True,
                         timeout=120)
    lines = out.stdout.splitlines()
    assert lines == ["exit handlers ran", *(["interpreter teardown ran"] if teardown else []), f"exit code {code}"], \
        out.stdout + out.stderr
    assert ("RuntimeError: boom" in out.stderr) == (how == "fail")


def test_a_start_method_the_user_chose_is_kept(monkeypatch):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.delenv(ENGINE_CORE_FORKS_WORKERS, raising=False)
    monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore")
    register_models()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_a_diffusion_core_forks_its_workers_only_where_the_user_chose_no_method(monkeypatch):
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.delenv(ENGINE_CORE_FORKS_WORKERS, raising=False)
    assert user_chose_no_start_method()
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert not user_chose_no_start_method()
    monkeypatch.setenv(ENGINE_CORE_FORKS_WORKERS, "1")  # the spawn our front end set for its own process
    assert user_chose_no_start_method()


def test_the_diffusion_executor_forks_only_a_one_thread_process(monkeypatch):
    """Why: a restart comes from a core whose engine threads run; a fork there may copy a lock another thread holds."""
    import torch

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # what the core sets (CoreSpec.fork_workers)
    monkeypatch.setattr(threading, "active_count", lambda: 1)  # this test process may run other tests' threads
    assert _worker_context().get_start_method() == ("spawn" if torch.cuda.is_initialized() else "fork")
    monkeypatch.setattr(threading, "active_count", lambda: 5)
    assert _worker_context().get_start_method() == "forkserver"  # preloaded: process_start.py
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv(ENGINE_CORE_FORKS_WORKERS, "1")  # our front end's spawn
    assert _worker_context().get_start_method() == "forkserver"
    monkeypatch.delenv(ENGINE_CORE_FORKS_WORKERS)  # the user's own
    assert _worker_context().get_start_method() == "spawn"
