"""Stand-in pipelines that isolate the runtime's contract (batching, per-request errors, slow and large outputs).

They run in real worker processes; only the model is fake. Each image is a pure function of (seed, prompt), so
a request gives the same pixels alone or inside a batch. Prompts steer behaviour:
"fail" -> that request fails with a 422, "break-batch" -> the whole forward raises (the runner then retries
one by one), "sleep:<s>" -> the forward sleeps, "big" -> a 4 MB array output (travels through shared memory),
"bad-output" -> an output that cannot be encoded (a lone surrogate). `FakeStepPipeline` runs a denoise-like
loop of `num_inference_steps` steps that checks for aborts before every step, as the real pipelines do;
`FakeCollectivePipeline` one with a collective per step across the worker's ranks.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.errors import OmniClientError


def seeded_pixels(seed: int, prompt: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random uint8 pixels that depend on (seed, prompt) only."""
    mix = int.from_bytes(hashlib.sha256(f"{seed}:{prompt}".encode()).digest()[:8], "little")
    return np.random.default_rng(mix).integers(0, 256, shape, dtype=np.uint8)


def fake_image(seed: int, prompt: str, size: int) -> Image.Image:
    return Image.fromarray(seeded_pixels(seed, prompt, (size, size, 3)))


class FakeBatchPipeline:
    supports_request_batch: ClassVar[bool] = True

    def __init__(self, od_config: OmniDiffusionConfig) -> None:
        self.od_config = od_config

    @classmethod
    def from_pretrained(cls, od_config: OmniDiffusionConfig, model_dir: Path, device: Any, dtype: Any):
        return cls(od_config)

    def forward(self, batch: DiffusionRequestBatch, ctx: StepContext) -> list[DiffusionOutput]:
        prompts = [r.prompt_text for r in batch.requests]
        if "break-batch" in prompts:
            raise RuntimeError("break-batch in this batch")
        for p in prompts:
            if p.startswith("sleep:"):
                time.sleep(float(p.split(":")[1]))
        return [self._one(r, len(batch)) for r in batch.requests]

    def _one(self, request, batch_size: int) -> DiffusionOutput:
        sp = request.sampling_params
        if request.prompt_text == "fail":
            return DiffusionOutput.from_exception(OmniClientError("prompt 'fail' is refused", status_code=422))
        if request.prompt_text == "bad-output":
            return DiffusionOutput(output={"caption": "\ud800"})
        if request.prompt_text == "big":
            return DiffusionOutput(output={"array": np.arange(1_000_000, dtype=np.float32)})
        size = sp.height or 16
        images = [fake_image((sp.seed or 0) + i, request.prompt_text, size) for i in range(sp.num_outputs_per_prompt)]
        return DiffusionOutput(output=images, stage_durations={"denoise": 0.0}, extra={"batch_size": batch_size})


class FakeStepPipeline(FakeBatchPipeline):
    """`STEP_S` seconds per step; before every step the aborted rows leave with a 499 and the others go on.
    `extra["steps_run"]` says how many steps a request ran, `extra["rows_left"]` how many rows of its forward
    were still running when it finished."""

    STEP_S = 0.02

    def forward(self, batch: DiffusionRequestBatch, ctx: Any = None) -> list[DiffusionOutput]:
        done: dict[str, DiffusionOutput] = {}
        steps_run = dict.fromkeys(batch.request_ids, 0)
        active = list(batch.requests)
        while active:
            for rid in ctx.aborted([r.request_id for r in active]):
                done[rid] = DiffusionOutput(error="request aborted", error_status_code=499, error_type="aborted")
            active = [r for r in active if r.request_id not in done]
            finished = [r for r in active if steps_run[r.request_id] >= (r.sampling_params.num_inference_steps or 1)]
            for r in finished:
                done[r.request_id] = self._one(r, len(batch))
                done[r.request_id].extra.update(steps_run=steps_run[r.request_id], rows_left=len(active))
            active = [r for r in active if r.request_id not in done]
            if active:
                time.sleep(self.STEP_S)
                for r in active:
                    steps_run[r.request_id] += 1
        return [done[rid] for rid in batch.request_ids]


class FakeCollectivePipeline(FakeBatchPipeline):
    """A prompt "collective" runs `num_inference_steps` steps that each all-reduce across the worker's ranks (as
    a TP forward does), checking for aborts before every step; rank 1 reaches each check `LAG_S` after rank 0, so
    an abort mostly lands between the two ranks' checks of one step. Each rank writes how many steps it ran to
    `<model dir>/<request id>.rank<r>`. Other prompts behave as in `FakeBatchPipeline`."""

    LAG_S = 0.05

    def forward(self, batch: DiffusionRequestBatch, ctx: StepContext) -> list[DiffusionOutput]:
        if [r.prompt_text for r in batch.requests] != ["collective"]:
            return super().forward(batch, ctx)
        import torch
        from vllm.distributed.parallel_state import get_world_group

        (request,) = batch.requests
        group, step = get_world_group(), 0
        while step < request.sampling_params.num_inference_steps and not ctx.aborted([request.request_id]):
            torch.distributed.all_reduce(torch.ones(1), group=group.cpu_group)
            step += 1
            if group.rank_in_group == 1:
                time.sleep(self.LAG_S)
        Path(self.od_config.model, f"{request.request_id}.rank{group.rank_in_group}").write_text(str(step))
        return [self._one(request, 1)]


class FakeSingleRequestPipeline(FakeBatchPipeline):
    supports_request_batch: ClassVar[bool] = False


class FailingLoadPipeline(FakeBatchPipeline):
    @classmethod
    def from_pretrained(cls, od_config, model_dir, device, dtype):
        raise FileNotFoundError("no weights here: transformer/diffusion_pytorch_model.safetensors")


class SlowLoadPipeline(FakeBatchPipeline):
    """Loads for 10 minutes (a large model): writes `loading` into the model directory when it begins."""

    @classmethod
    def from_pretrained(cls, od_config, model_dir, device, dtype):
        (Path(model_dir) / "loading").write_text(str(time.time()))
        time.sleep(600)
        return super().from_pretrained(od_config, model_dir, device, dtype)


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"
