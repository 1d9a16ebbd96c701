"""Partial images (`partial_images`): decoded previews at evenly spaced steps, in request and step mode.

Pins: a request asking for k previews gets k "partial_image" partials (indices 0..k-1, full-size images) after
evenly spaced steps and never after the last one; a request that asks for none gets none while sharing the
forward; the final output is bitwise the one without previews; every step reports progress.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_step_execution import Harness, make

from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.previews import preview_steps
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.models.flux.pipeline import FluxPipeline
from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline

PIPELINES = {"qwen-image": QwenImagePipeline, "flux": FluxPipeline}


@pytest.fixture(scope="module")
def pipes(dist_world):
    out = {}
    for name, cls in PIPELINES.items():
        model_dir = build_tiny(name)
        out[name] = cls.from_pretrained(OmniDiffusionConfig(model=str(model_dir)), model_dir, torch.device("cpu"),
                                        torch.float32)
    return out


def test_preview_steps_are_evenly_spaced_and_never_the_last():
    assert preview_steps(20, 3) == [5, 10, 15]
    assert preview_steps(6, 2) == [2, 4]
    assert preview_steps(2, 3) == [1]
    assert preview_steps(1, 2) == [] and preview_steps(20, 0) == []


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict]] = []

    def __call__(self, request_id: str, kind: str, data: dict) -> None:
        self.events.append((request_id, kind, data))

    def previews(self, request_id: str) -> list[dict]:
        return [d for r, k, d in self.events if r == request_id and k == "partial_image"]

    def progress(self, request_id: str) -> list[int]:
        return [d["step"] for r, k, d in self.events if r == request_id and k == "progress"]


def previewing(name: str, rid: str, steps: int, count: int, seed: int):
    request = make(name, rid, steps=steps, seed=seed, size=32)
    request.sampling_params.partial_images = count
    request.sampling_params.output_type = "pil"
    return request


@pytest.mark.parametrize("name", list(PIPELINES))
def test_request_mode_previews(pipes, name):
    pipe = pipes[name]
    sink = Sink()
    wants, plain = previewing(name, "wants", 6, 2, 1), previewing(name, "plain", 6, 0, 2)
    ctx = StepContext(pipe.od_config, request_ids=["wants", "plain"], partial_sink=sink)
    outputs = pipe.forward(DiffusionRequestBatch([wants, plain]), ctx)
    previews = sink.previews("wants")
    assert [p["index"] for p in previews] == [0, 1] and not sink.previews("plain")
    assert all(len(p["images"]) == 1 and p["images"][0].size == (32, 32) for p in previews)
    assert sink.progress("wants") == [1, 2, 3, 4, 5, 6]
    final = np.asarray(outputs[0].output[0])
    assert not np.array_equal(np.asarray(previews[0]["images"][0]), final)  # a preview, not the result
    without = pipe.forward(DiffusionRequestBatch([previewing(name, "wants", 6, 0, 1), plain]))[0]
    np.testing.assert_array_equal(final, np.asarray(without.output[0]))  # previews leave the result as it was


def test_step_mode_previews(pipes):
    pipe = pipes["qwen-image"]
    harness = Harness(pipe, max_num_seqs=2)
    sink = Sink()
    harness.executor.add(0, [previewing("qwen-image", "a", 4, 3, 1)], sink)
    harness.ids["a"] = 0
    harness.drain()
    assert [p["index"] for p in sink.previews("a")] == [0, 1, 2]
    assert harness.outputs["a"].error is None
