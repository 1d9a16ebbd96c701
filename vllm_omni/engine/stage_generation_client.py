"""GENERATION stage: a non-autoregressive model (e.g. a vocoder) run in this process on batched inputs.

The model class is named by the stage's `model_class` engine argument ("module:Class"). It must provide
`from_pretrained(model_dir, device=..., dtype=...)`, `forward(items: list) -> list` (one result per item, in
order) and `output_modality`. A request's prompt is its list of items (e.g. codec chunks); requests that
arrive together share one `forward` call (up to `max_batch_size` items). The model runs with `torch_num_threads`
torch threads (resolved with the pipeline: the engine process's share of the CPUs the AR workers leave).
"""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.messages import StageRpcError
from vllm_omni.engine.stage_client import StageClientBase, cancel_task
from vllm_omni.errors import OmniClientError
from vllm_omni.outputs import OmniRequestOutput


class StageGenerationClient(StageClientBase):
    kind = StageKind.GENERATION

    def __init__(self, config, replica_id: int = 0) -> None:
        super().__init__(config, replica_id)
        self.model: Any = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"generation-stage{self.stage_id}")
        self._pending: list[tuple[str, list[Any], asyncio.Future]] = []
        self._wakeup: asyncio.Event | None = None
        self._batcher: asyncio.Task | None = None
        self.max_batch_size = int(config.engine_args.get("max_batch_size", 64))

    async def start(self) -> None:
        import torch

        target = self.config.engine_args.get("model_class")
        if not target or ":" not in target:
            raise ValueError(f"{self.name}: a generation stage needs engine_args.model_class='module:Class'")
        module, cls_name = target.split(":")
        model_cls = getattr(importlib.import_module(module), cls_name)
        dtype = getattr(torch, self.config.engine_args.get("dtype", "float32"))
        device = self.config.engine_args.get("device", "cpu")
        threads = self.config.torch_num_threads
        loop = asyncio.get_running_loop()
        start = time.perf_counter()

        def load() -> Any:
            # On the thread that runs the model: torch's process-wide count is taken up per thread, lazily.
            if threads is not None:  # None: a stage config built by hand, not resolved with its pipeline
                torch.set_num_threads(threads)
            return model_cls.from_pretrained(self.config.model, device=device, dtype=dtype)

        self.model = await asyncio.wait_for(loop.run_in_executor(self._executor, load),
                                            timeout=self.config.stage_init_timeout)
        self.startup_phases = {"load": time.perf_counter() - start}
        self.on_loop()

    def on_loop(self) -> None:
        """The batcher runs on the loop that drives the stage (moved there from `start`'s)."""
        if self._batcher is not None:
            self._batcher.cancel()
        self._wakeup = asyncio.Event()
        self._batcher = asyncio.create_task(self._run_batches())

    @property
    def output_modality(self) -> str:
        return self.config.final_output_type or getattr(self.model, "output_modality", "audio")

    def default_sampling_params(self) -> Any:
        return None

    async def generate(self, request_id: str, prompt: Any, sampling_params: Any) -> AsyncIterator[OmniRequestOutput]:
        items = list(prompt) if isinstance(prompt, list | tuple) else None
        if not items:
            raise OmniClientError(f"stage {self.stage_id} (generation) needs a non-empty list of inputs",
                                  param="prompt")
        start = time.perf_counter()
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request_id, items, future))
        self._wakeup.set()
        try:
            results = await future
        finally:
            self._pending = [p for p in self._pending if p[2] is not future]
        out = OmniRequestOutput(request_id=request_id, finished=True, stage_id=self.stage_id,
                                final_output_type=self.output_modality)
        elapsed = time.perf_counter() - start
        out.stage_durations = self.stage_durations(elapsed)
        if self.output_modality == "audio":
            out.multimodal_output = {"audio": np.concatenate(results),
                                     "sample_rate": getattr(self.model, "sample_rate", None)}
        else:
            out.multimodal_output = {self.output_modality: results}
        yield out

    async def _run_batches(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                batch, size = [], 0
                for entry in list(self._pending):
                    if batch and size + len(entry[1]) > self.max_batch_size:
                        break
                    batch.append(entry)
                    size += len(entry[1])
                self._pending = self._pending[len(batch):]
                items = [item for _, entry_items, _ in batch for item in entry_items]
                try:
                    results = await loop.run_in_executor(self._executor, self.model.forward, items)
                except Exception as e:
                    for _, _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    continue
                offset = 0
                for _, entry_items, future in batch:
                    if not future.done():
                        future.set_result(results[offset:offset + len(entry_items)])
                    offset += len(entry_items)

    async def abort(self, request_ids: list[str]) -> None:
        aborted = set(request_ids)
        for request_id, _, future in self._pending:
            if request_id in aborted and not future.done():
                future.cancel()
        self._pending = [p for p in self._pending if p[0] not in aborted]

    async def collective_rpc_async(self, method: str, timeout: float | None = None, args: tuple = (),
                                   kwargs: dict[str, Any] | None = None) -> Any:
        fn = getattr(self.model, method, None)
        if fn is None:
            return StageRpcError(stage_id=self.stage_id, replica_id=self.replica_id, method=method,
                                 reason="unsupported", error=f"{type(self.model).__name__} has no method {method!r}")
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(self._executor, lambda: fn(*args, **(kwargs or {}))),
                                      timeout=timeout)

    @property
    def is_dead(self) -> bool:
        return self._batcher is not None and self._batcher.done() and not self._batcher.cancelled()

    def shutdown(self) -> None:
        if self._batcher is not None:
            cancel_task(self._batcher)
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.model = None
