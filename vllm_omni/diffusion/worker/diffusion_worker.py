"""One rank of the diffusion stage: its device, its process groups and its model runner.

Only the methods in `RPC_METHODS` can be called from the engine with `collective_rpc`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
from collections.abc import Callable
from typing import Any

import torch

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.distributed.parallel_state import destroy_diffusion_distributed, init_diffusion_distributed
from vllm_omni.diffusion.layers.compile import compiled_forwards
from vllm_omni.diffusion.lora import LoRAManager
from vllm_omni.diffusion.step_context import PartialSink
from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.lora import LoRARef
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

RPC_METHODS = frozenset({"ping", "sleep", "wake_up", "load_lora", "unload_lora"})


def select_device(od_config: OmniDiffusionConfig, rank: int) -> torch.device:
    kind = od_config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    return torch.device(kind)


class DiffusionWorker:
    def __init__(
        self, od_config: OmniDiffusionConfig, rank: int, world_size: int, distributed_init_method: str | None,
        store_socket: socket.socket | None = None,
    ) -> None:
        self.od_config = od_config
        self.rank = rank
        self.world_size = world_size
        self.distributed_init_method = distributed_init_method
        self.store_socket = store_socket
        self.device = select_device(od_config, rank)
        self.model_runner = DiffusionModelRunner(od_config, self.device, rank)
        self.sleep_level = 0
        self._config_scope = contextlib.ExitStack()

    def init_device(self) -> None:
        from vllm.config import set_current_vllm_config

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # The stage resolution picks the share of the pipeline's processes; an engine built alone splits the
        # host's CPUs over its own ranks (each would otherwise start a thread per CPU).
        threads = self.od_config.torch_num_threads or max(1, len(os.sched_getaffinity(0)) // self.world_size)
        torch.set_num_threads(threads)
        vllm_config = init_diffusion_distributed(
            rank=self.rank,
            world_size=self.world_size,
            parallel_config=self.od_config.parallel_config,
            device=self.device,
            distributed_init_method=self.distributed_init_method,
            listen_socket=self.store_socket,
        )
        # vLLM layers read the "current" config while they are built and run; this rank has exactly one.
        self._config_scope.enter_context(set_current_vllm_config(vllm_config))

    def load_model(self) -> None:
        self.model_runner.load_model()

    def execute_model(self, batch: DiffusionRequestBatch, partial_sink: PartialSink | None = None,
                      abort_requested: Callable[[str], bool] | None = None) -> list[DiffusionOutput]:
        return self.model_runner.execute_model(batch, partial_sink, abort_requested)

    def ping(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.device), "sleep_level": self.sleep_level}

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Level 1: weights to host memory (nothing to move on CPU); level 2: drop the weights."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if level == 2:
            self.model_runner.unload_model()
            gc.collect()
        elif self.device.type != "cpu":
            self._move_modules(torch.device("cpu"))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.sleep_level = max(self.sleep_level, level)
        return self.ping()

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Restore what `sleep` released (reloading from the checkpoint after level 2); `tags` are accepted
        for API parity with vLLM, and every tag wakes the whole pipeline."""
        if self.model_runner.pipeline is None:
            self.model_runner.load_model()
        elif self.sleep_level == 1 and self.device.type != "cpu":
            self._move_modules(self.device)
        self.sleep_level = 0
        return self.ping()

    def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Make an adapter resident (the server registers a name only once every rank holds it); an
        OmniClientError names what is wrong with the file."""
        self._lora_manager().load(LoRARef(name, path, 1.0))
        return self.ping()

    def unload_lora(self, path: str) -> bool:
        return self._lora_manager().unload(path)

    def _lora_manager(self) -> LoRAManager:
        pipeline = self.model_runner.pipeline
        manager = getattr(pipeline, "lora_manager", None)
        if manager is None:
            why = f"{type(pipeline).__name__} takes no LoRA adapters" if self.od_config.enable_lora else \
                "start the server with --enable-lora"
            raise OmniClientError(f"lora: {why}", param="lora")
        return manager

    def _move_modules(self, device: torch.device) -> None:
        """Move the pipeline's modules; the CUDA graphs captured on the weights' old addresses are void."""
        pipeline = self.model_runner.pipeline
        if callable(getattr(pipeline, "to", None)):
            pipeline.to(device)
        else:
            for value in vars(pipeline).values():
                if isinstance(value, torch.nn.Module):
                    value.to(device)
        for compiled in compiled_forwards(pipeline):
            compiled.drop_cuda_graphs()

    def shutdown(self) -> None:
        self.model_runner.unload_model()
        self._config_scope.close()
        with contextlib.suppress(Exception):
            destroy_diffusion_distributed()
