"""The vLLM plugin hook lets an EngineCore fork its workers and leaves every other process's start method alone; a
diffusion core forks its workers under the same condition, only while it runs one thread."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from vllm_omni.diffusion.core.client import _user_chose_no_start_method
from vllm_omni.diffusion.executor.multiproc_executor import _worker_context
from vllm_omni.envs import ENGINE_CORE_FORKS_WORKERS
from vllm_omni.plugins import register_models


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


def test_a_start_method_the_user_chose_is_kept(monkeypatch):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.delenv(ENGINE_CORE_FORKS_WORKERS, raising=False)
    monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore")
    register_models()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_a_diffusion_core_forks_its_workers_only_where_the_user_chose_no_method(monkeypatch):
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.delenv(ENGINE_CORE_FORKS_WORKERS, raising=False)
    assert _user_chose_no_start_method()
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert not _user_chose_no_start_method()
    monkeypatch.setenv(ENGINE_CORE_FORKS_WORKERS, "1")  # the spawn our front end set for its own process
    assert _user_chose_no_start_method()


def test_the_diffusion_executor_forks_only_a_one_thread_process(monkeypatch):
    """Why: a restart comes from a core whose engine threads run; a fork there may copy a lock another thread holds."""
    import torch

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # what the core sets (CoreSpec.fork_workers)
    monkeypatch.setattr(threading, "active_count", lambda: 1)  # this test process may run other tests' threads
    assert _worker_context().get_start_method() == ("spawn" if torch.cuda.is_initialized() else "fork")
    monkeypatch.setattr(threading, "active_count", lambda: 5)
    assert _worker_context().get_start_method() == "spawn"
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert _worker_context().get_start_method() == "spawn"
