"""vLLM CPU worker / model runner for the Qwen3-Omni talker stage (`worker_cls=TALKER_CPU_WORKER`).

The only addition to vLLM's runner: before each forward the model learns which request owns which rows of the
flattened batch (and that request's `extra_args`), and finished requests are reported to it so their frames
become collectable. Scheduling, KV cache, sampling and batching stay vLLM's.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_omni.models.qwen3_omni.vllm_talker import TalkerRow

TALKER_CPU_WORKER = "vllm_omni.models.qwen3_omni.talker_worker.TalkerCPUWorker"


class TalkerCPUModelRunner(CPUModelRunner):
    def _update_states(self, scheduler_output):
        result = super()._update_states(scheduler_output)
        if scheduler_output.finished_req_ids:
            self.model.finish_requests(scheduler_output.finished_req_ids)
        return result

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        num_reqs = self.input_batch.num_reqs
        bounds = self.query_start_loc.np[:num_reqs + 1].tolist()
        rows = []
        for i, req_id in enumerate(self.input_batch.req_ids[:num_reqs]):
            state = self.requests.get(req_id)
            params = state.sampling_params if state is not None else None
            rows.append(TalkerRow(req_id, bounds[i], bounds[i + 1], params.extra_args if params else None))
        self.model.begin_step(rows)
        try:
            return super()._model_forward(input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs)
        finally:
            self.model.end_step()


class TalkerCPUWorker(CPUWorker):
    def init_device(self) -> None:
        super().init_device()
        self.model_runner = TalkerCPUModelRunner(self.vllm_config, torch.device("cpu"))

    def take_talker_frames(self, keys: list[str]) -> dict[str, list[list[int]] | None]:
        return self.model_runner.model.take_frames(keys)

    def peek_talker_frames(self, keys: list[str]) -> dict[str, list[list[int]]]:
        return self.model_runner.model.peek_frames(keys)
