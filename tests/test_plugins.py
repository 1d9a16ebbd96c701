"""The vLLM plugin hook lets an EngineCore fork its workers and leaves every other process's start method alone."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from vllm_omni.plugins import ENGINE_CORE_FORKS_WORKERS, register_models


@pytest.mark.parametrize(("process_name", "method"), [("EngineCore", "fork"), ("EngineCore_DP1", "fork"),
                                                      ("MainProcess", "spawn"), ("VllmWorker-0", "spawn")])
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
