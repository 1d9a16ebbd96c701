"""Stand-in pipeline that reports denoise progress and emits decoded video chunks, like the Wan pipelines do.

The clip is a pure function of (seed, prompt); prompt "stream-fail" fails the request after its partials.
"""

from __future__ import annotations

import numpy as np
from fake_pipelines import FakeBatchPipeline, seeded_pixels

from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.errors import OmniClientError

NUM_STEPS = 5
CHUNK_FRAMES = (1, 4, 4)
SIZE = 320
"""320x320x3x4 frames = 1.2 MB: the later chunks travel through shared memory."""


def fake_clip(seed: int, prompt: str) -> np.ndarray:
    return seeded_pixels(seed, prompt, (sum(CHUNK_FRAMES), SIZE, SIZE, 3))


class FakeStreamingPipeline(FakeBatchPipeline):
    def forward(self, batch: DiffusionRequestBatch, ctx: StepContext) -> list[DiffusionOutput]:
        for step in range(NUM_STEPS):
            ctx.report_progress(step + 1, NUM_STEPS)
        clips = [fake_clip(r.sampling_params.seed or 0, r.prompt_text) for r in batch.requests]
        start = 0
        for size in CHUNK_FRAMES:
            for request, clip in zip(batch.requests, clips, strict=True):
                ctx.emit_partial(request.request_id, "video_chunk",
                                 {"video": clip[start:start + size], "fps": 8, "frame_start": start})
            start += size
        outputs = []
        for request, clip in zip(batch.requests, clips, strict=True):
            if request.prompt_text == "stream-fail":
                error = OmniClientError("refused after streaming", status_code=422)
                outputs.append(DiffusionOutput.from_exception(error))
            else:
                outputs.append(DiffusionOutput(output={"video": clip, "fps": 8}))
        return outputs
