"""Offline, batched API: `Omni(model).generate(prompts, sampling_params_list)`.

The engine runs on one background event loop thread of this object (as vLLM's `LLM` owns a sync engine);
`generate` blocks on the outputs that loop hands over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import queue
import threading
import uuid
from collections.abc import Coroutine
from typing import Any

from tqdm.auto import tqdm

from vllm_omni.entrypoints.omni_base import OmniBase
from vllm_omni.errors import EngineDeadError, OmniClientError, OmniError
from vllm_omni.outputs import OmniRequestOutput

_POLL_S = 1.0
_LOOP_CALL_TIMEOUT_S = 60.0
"""Bound on a call run on the engine's loop (adding requests, an abort, the shutdown)."""


class Omni(OmniBase):
    """Runs every prompt through the whole pipeline; returns one output per (prompt, final stage)."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="OmniLoop", daemon=True)
        self._thread.start()
        self.run_in_loop(self._bind()).result(timeout=_LOOP_CALL_TIMEOUT_S)

    async def _bind(self) -> None:
        self.engine.bind_loop()

    def run_in_loop(self, coro: Coroutine) -> concurrent.futures.Future:
        """Run `coro` on the loop that drives the stages (e.g. a call on a stage's vLLM AsyncLLM)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def generate(self, prompts: Any, sampling_params_list: Any = None, *, use_tqdm: bool = True,
                 timeout: float | None = None, output_modalities: list[str] | None = None
                 ) -> list[OmniRequestOutput]:
        """`output_modalities` (e.g. ["text"]) stops each request after the last stage making one of them."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = [self._final_only(p) for p in self._resolve_sampling_params(sampling_params_list)]
        batch = uuid.uuid4().hex[:8]
        request_ids = [f"{i}-{batch}" for i in range(len(prompts))]
        outputs: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

        async def add_all() -> None:
            for rid, prompt in zip(request_ids, prompts, strict=False):
                self.engine.add_request(rid, prompt, params, lambda item, rid=rid: outputs.put((rid, item)),
                                        output_modalities)

        self.run_in_loop(add_all()).result(timeout=_LOOP_CALL_TIMEOUT_S)
        finals: dict[str, dict[int, OmniRequestOutput]] = {rid: {} for rid in request_ids}
        pending = set(request_ids)
        waited = 0.0
        with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm) as bar:
            while pending:
                try:
                    rid, item = outputs.get(timeout=_POLL_S)
                except queue.Empty:
                    waited += _POLL_S
                    self._check_alive(pending, waited, timeout)
                    continue
                waited = 0.0
                if isinstance(item, BaseException):
                    if isinstance(item, OmniClientError) and item.status_code == 400:
                        self._abort(sorted(pending - {rid}))
                        raise item
                    status = item.status_code if isinstance(item, OmniError) else 500
                    finals[rid][-1] = OmniRequestOutput(request_id=rid, error=str(item), error_status_code=status)
                    done = True
                else:
                    finals[rid][item.stage_id] = item
                    done = item.finished
                    if done:  # every stage is done: each output kept is its stage's last (the audio may end first)
                        for out in finals[rid].values():
                            out.finished = True
                if done:
                    pending.discard(rid)
                    bar.update(1)
        return [out for rid in request_ids for _, out in sorted(finals[rid].items())]

    def _check_alive(self, pending: set[str], waited: float, timeout: float | None) -> None:
        if self.engine.is_dead:
            raise EngineDeadError(f"engine died: {self.engine.dead_error}")
        if timeout is not None and waited >= timeout:
            self._abort(sorted(pending))
            raise TimeoutError(f"no output for {waited:.0f} s; aborted {len(pending)} request(s)")

    def _abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self.run_in_loop(self.engine.abort(request_ids)).result(timeout=_LOOP_CALL_TIMEOUT_S)

    def _final_only(self, params: Any) -> Any:
        """Offline callers want whole results: skip per-token streaming in AR stages."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if isinstance(params, SamplingParams) and params.output_kind != RequestOutputKind.FINAL_ONLY:
            params = copy.copy(params)
            params.output_kind = RequestOutputKind.FINAL_ONLY
        return params

    def close(self) -> None:
        """Shut the engine down on its loop, then stop the loop and its thread."""
        loop = getattr(self, "_loop", None)
        if loop is None or loop.is_closed():
            return super().close()
        if self._thread.is_alive():
            self.run_in_loop(self.engine.shutdown_async()).result(timeout=_LOOP_CALL_TIMEOUT_S)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=_LOOP_CALL_TIMEOUT_S)
        if not self._thread.is_alive():
            loop.close()
