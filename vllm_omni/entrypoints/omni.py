"""Offline, batched API: `Omni(model).generate(prompts, sampling_params_list)`."""

from __future__ import annotations

import copy
import queue
import uuid
from typing import Any

from tqdm.auto import tqdm

from vllm_omni.engine.messages import ErrorMessage
from vllm_omni.entrypoints.omni_base import OmniBase
from vllm_omni.errors import EngineDeadError, OmniClientError
from vllm_omni.outputs import OmniRequestOutput

_POLL_S = 1.0


class Omni(OmniBase):
    """Runs every prompt through the whole pipeline; returns one output per (prompt, final stage)."""

    def generate(self, prompts: Any, sampling_params_list: Any = None, *, use_tqdm: bool = True,
                 timeout: float | None = None, output_modalities: list[str] | None = None
                 ) -> list[OmniRequestOutput]:
        """`output_modalities` (e.g. ["text"]) stops each request after the last stage making one of them."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = [self._final_only(p) for p in self._resolve_sampling_params(sampling_params_list)]
        batch = uuid.uuid4().hex[:8]
        request_ids = [f"{i}-{batch}" for i in range(len(prompts))]
        for rid, prompt in zip(request_ids, prompts, strict=False):
            self.engine.add_request(rid, prompt, params, output_modalities)
        finals: dict[str, dict[int, OmniRequestOutput]] = {rid: {} for rid in request_ids}
        pending = set(request_ids)
        waited = 0.0
        with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm) as bar:
            while pending:
                try:
                    msg = self.engine.output_queue.get(timeout=_POLL_S)
                except queue.Empty:
                    waited += _POLL_S
                    self._check_alive(pending, waited, timeout)
                    continue
                waited = 0.0
                rid = msg.request_id
                if rid not in pending:
                    if isinstance(msg, ErrorMessage) and msg.fatal:
                        raise EngineDeadError(msg.error)
                    continue
                if isinstance(msg, ErrorMessage):
                    if msg.status_code == 400:
                        self.engine.abort(sorted(pending - {rid}))
                        raise OmniClientError(msg.error, param=msg.param)
                    finals[rid][-1] = OmniRequestOutput(request_id=rid, error=msg.error,
                                                        error_status_code=msg.status_code)
                    done = True
                else:
                    finals[rid][msg.stage_id] = msg
                    done = msg.finished
                if done:
                    pending.discard(rid)
                    bar.update(1)
        return [out for rid in request_ids for _, out in sorted(finals[rid].items())]

    def _check_alive(self, pending: set[str], waited: float, timeout: float | None) -> None:
        if self.engine.is_dead:
            raise EngineDeadError(f"engine died: {self.engine.dead_error}")
        if timeout is not None and waited >= timeout:
            self.engine.abort(sorted(pending))
            raise TimeoutError(f"no output for {waited:.0f} s; aborted {len(pending)} request(s)")

    def _final_only(self, params: Any) -> Any:
        """Offline callers want whole results: skip per-token streaming in AR stages."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if isinstance(params, SamplingParams) and params.output_kind != RequestOutputKind.FINAL_ONLY:
            params = copy.copy(params)
            params.output_kind = RequestOutputKind.FINAL_ONLY
        return params
