"""How the diffusion runtime starts its core and worker processes where it cannot fork them.

A fresh interpreter imports torch, vLLM and our runtime for 5-7 s of a 2-core machine. Where the starting process
runs threads (a core restarting a worker while its engine threads run, an `Omni` starting its core, an engine in a
test process), fork is unsafe, so the child comes from multiprocessing's forkserver, preloaded with `CORE_MODULES`:
the first start in a process pays the imports once, like a spawn; every later one forks them. A forkserver child
would otherwise get the server's environment and stdout/stderr, fixed when the server started: `child_process`
hands it the starter's of the moment, as a spawned child has them.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from multiprocessing import reduction
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

from vllm_omni.envs import ENGINE_CORE_FORKS_WORKERS

CORE_MODULES = ("vllm.config", "vllm_omni.diffusion.diffusion_engine", "vllm_omni.diffusion.core.core",
                "vllm_omni.diffusion.worker.diffusion_worker")
"""What a core imports before its engine runs (vllm.config: the logging set-up; 5-20 s of a 2-core import),
and what its workers import before they load."""


def user_chose_no_start_method() -> bool:
    """No `VLLM_WORKER_MULTIPROC_METHOD`, or only the `spawn` our front end set for its own process
    (async_omni_engine.py, `envs.ENGINE_CORE_FORKS_WORKERS`)."""
    return "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ or os.environ.get(ENGINE_CORE_FORKS_WORKERS) == "1"


def start_context() -> BaseContext:
    """The forkserver, preloaded with `CORE_MODULES`, unless the user chose `VLLM_WORKER_MULTIPROC_METHOD=spawn`."""
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn" and not user_chose_no_start_method():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(CORE_MODULES))  # read when this process's server starts
    return context


def child_process(context: BaseContext, target: Callable[..., None], args: tuple, name: str,
                  daemon: bool = False) -> BaseProcess:
    """`context.Process(target, args)`, unstarted; from a forkserver or spawn context it runs in this process's
    environment and on its stdout/stderr at the time it starts (`run_with_environ`)."""
    if context.get_start_method() != "fork":
        args = (dict(os.environ), _Stdio(), target, *args)
        target = run_with_environ
    return context.Process(target=target, args=args, name=name, daemon=daemon)


class _Stdio:
    """This process's stdout and stderr descriptors, duplicated into the child when pickled for it (as
    multiprocessing passes a `Connection`)."""

    def __reduce__(self) -> tuple:
        return _received, (reduction.DupFd(1), reduction.DupFd(2))


def _received(*dups: Any) -> tuple[int, ...]:
    return tuple(dup.detach() for dup in dups)


def run_with_environ(environ: dict[str, str], stdio: tuple[int, int], target: Callable[..., None],
                     *args: Any) -> None:
    """Process entry point: `target(*args)` in the starter's environment, writing where it wrote."""
    os.environ.clear()
    os.environ.update(environ)
    for fd, received in zip((1, 2), stdio, strict=True):
        os.dup2(received, fd)
        os.close(received)
    target(*args)
