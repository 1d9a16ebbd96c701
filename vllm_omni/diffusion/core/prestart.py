"""A diffusion core process started before its stage exists: `vllm serve` forks it at its entry, and the first
diffusion stage becomes that process instead of spawning one.

A spawned core is a fresh interpreter that imports torch and vLLM again (6-7 s on 2 cores), and it starts only
once the API process has imported its server and resolved the config (8 s more), one after the other. At the
CLI's entry the API process has imported torch and vLLM and runs one thread, where fork is safe (vLLM's own
front end forks its EngineCore likewise): the child gets both imports for free, imports the core's own modules
while the parent goes on, and waits. The stage hands it its `CoreSpec` and the environment a spawned core would
have started with (this process's, inside `spawn_environ`), and it runs `run_diffusion_core` from there. Devices
are chosen by that environment too: nothing in the child touches CUDA before it is applied.

Never handed a spec (no diffusion stage took it, a start-up error) it is stopped once the stages started, at the
latest from multiprocessing's exit handlers, before they join the children; it exits by itself when the pipe
closes (this process gone).

Where no such fork is at hand, cores and workers come from multiprocessing's forkserver with the same modules
preloaded (`process_start.py`).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.util import Finalize
from typing import Any

from vllm_omni.diffusion.process_start import CORE_MODULES
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

class PrestartedCore:
    """One forked core process, handed to at most one stage (`adopt`)."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        """`preload`: modules the stage will import too (its pipeline's), imported in the child after
        `CORE_MODULES`."""
        context = multiprocessing.get_context("fork")
        reader, self._writer = context.Pipe(duplex=False)
        self._devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.process: BaseProcess = context.Process(target=_wait_for_spec,
                                                    args=(reader, self._writer, CORE_MODULES + preload),
                                                    name="DiffusionCore-prestarted")
        self.process.start()
        reader.close()
        self._finalizer = Finalize(self, _release, args=(self._writer, self.process), exitpriority=20)

    def adopt(self, spec: Any, name: str) -> BaseProcess | None:
        """The process, now running the core for `spec` with this process's current environment; None when it
        was adopted already, is gone, or the stage runs on other devices than this process did at the fork:
        the child's imports may have initialized CUDA, which then keeps the devices it saw (the caller spawns a
        core then)."""
        if self._writer.closed or not self.process.is_alive():
            return None
        if os.environ.get("CUDA_VISIBLE_DEVICES") != self._devices:
            self.close()
            return None
        try:
            self._writer.send((spec, dict(os.environ), time.time()))
        except (BrokenPipeError, ConnectionResetError):  # it died meanwhile
            self._finalizer()
            return None
        self._finalizer.cancel()  # the stage's client stops it from now on
        self._writer.close()
        self.process.name = name
        return self.process

    def close(self) -> None:
        """Stop the process unless a stage adopted it; idempotent."""
        self._finalizer()


def _release(writer: Connection, process: BaseProcess) -> None:
    """Stop an unadopted child at once: it holds nothing but its imports, which a closed pipe would only end
    once they are done (seconds under load)."""
    writer.close()
    process.terminate()
    process.join(5.0)
    if process.is_alive():
        process.kill()
        process.join(1.0)


def _wait_for_spec(reader: Connection, writer: Connection, modules: tuple[str, ...]) -> None:
    """The forked child: import what the core runs, then wait for its spec (or the end of the pipe)."""
    writer.close()  # the parent's end: only the parent's copy may keep the pipe open
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when its stages stop
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the stage's own import of it reports the error where it fails the start
            logger.debug("prestarted diffusion core: importing %s failed: %r", name, exc)
    from vllm_omni.diffusion.core.core import run_diffusion_core

    try:
        spec, environ, adopted_at = reader.recv()
    except EOFError:  # never adopted
        os._exit(0)
    reader.close()
    os.environ.clear()
    os.environ.update(environ)
    run_diffusion_core(spec, adopted_at=adopted_at)
