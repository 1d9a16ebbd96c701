"""Co-batched step execution: one transformer forward per group of compatible resident states, with parity.

Pins, for every native pipeline (Qwen-Image, Qwen-Image-Edit, FLUX, Wan2.1 T2V / I2V, Wan2.2 A14B, Wan2.2
TI2V-5B) on tiny random weights in this process (CPU fp32): requests with different prompts (so different text
lengths), seeds, step counts, guidance scales and CFG on/off share transformer forwards while the batch changes
mid-flight (one joins at a later step, one leaves early with fewer steps, one takes its place), and each ends
with the output it has alone in request mode (PSNR >= 60 dB; most are bitwise, the others about 90 dB);
Wan2.2 A14B never mixes its two experts in one forward; the token cap splits a group into several forwards
(cap 1 = one forward per state, bitwise); a request whose rows make the shared forward fail is retired alone
with its error while the others end as they would have alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from step_harness import Harness
from step_pipelines import FaultyQwenImagePipeline, FaultyWanPipeline

from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.diffusion.worker.step_runner import split_by_tokens
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP
from vllm_omni.models.flux.pipeline import FluxPipeline
from vllm_omni.models.qwen_image import pipeline_edit
from vllm_omni.models.qwen_image.pipeline_edit import QwenImageEditPipeline
from vllm_omni.models.wan.pipeline_i2v import WanImageToVideoPipeline

CPU = torch.device("cpu")
WAN_SIZE = dict(height=32, width=48, num_frames=5, max_sequence_length=32)
IMAGE_SIZE = dict(height=32, width=32, output_type="np")
FAMILIES = {
    # tiny checkpoint, pipeline class, whether requests carry an input image
    "qwen-image": ("qwen-image", FaultyQwenImagePipeline, False),
    "qwen-image-edit": ("qwen-image-edit", QwenImageEditPipeline, True),
    "flux": ("flux", FluxPipeline, False),
    "wan2.1-t2v": ("wan2.1-t2v", FaultyWanPipeline, False),
    "wan2.1-i2v": ("wan2.1-i2v", WanImageToVideoPipeline, True),
    "wan2.2-t2v-a14b": ("wan2.2-t2v-a14b", FaultyWanPipeline, False),
    "wan2.2-ti2v-5b": ("wan2.2-ti2v-5b", WanImageToVideoPipeline, True),
}
PROMPTS = ["a cat holding a sign that says hello world, in a sunny garden full of flowers", "a red car",
           "mountains and a lake at dawn"]


class ForwardLog:
    """Records, per transformer forward, how many states shared it (and the Wan expert it ran)."""

    def __init__(self, pipe) -> None:
        self.sizes: list[int] = []
        self.experts: list[bool | None] = []
        self._forward = pipe.forward_step_inputs

    def __call__(self, inputs, states):
        self.sizes.append(len(inputs))
        self.experts.append(getattr(inputs[0], "high_noise", None))
        return self._forward(inputs, states)


@pytest.fixture(scope="module")
def pipes(dist_world):
    out = {}
    for name, (tiny, cls, _) in FAMILIES.items():
        model_dir = build_tiny(tiny)
        out[name] = cls.from_pretrained(OmniDiffusionConfig(model=str(model_dir)), model_dir, CPU, torch.float32)
    return out


@pytest.fixture
def logged(pipes, monkeypatch):
    """The pipeline of a family with its forwards recorded; Qwen-Image-Edit conditions on a 64^2-area image
    instead of 1024^2 (for speed: step and solo runs alike)."""
    monkeypatch.setattr(pipeline_edit, "CONDITION_AREA", 64 * 64)

    def get(name: str):
        pipe = pipes[name]
        log = ForwardLog(pipe)
        monkeypatch.setattr(pipe, "forward_step_inputs", log)
        return pipe, log
    return get


def image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8))


def make(name: str, rid: str, steps: int, seed: int, prompt: str, cfg: bool, scale: float = 4.0
         ) -> OmniDiffusionRequest:
    data: dict = {"prompt": prompt}
    if FAMILIES[name][2]:
        data["multi_modal_data"] = {"image": image(seed)}
    if name.startswith("wan"):
        size = {**WAN_SIZE, "width": 64} if name == "wan2.2-ti2v-5b" else WAN_SIZE  # 16x VAE, 2x2 patches
        sp = SP(num_inference_steps=steps, seed=seed, guidance_scale=scale if cfg else 1.0, **size)
    else:
        data["negative_prompt"] = "blurry, low quality" if cfg else None
        sp = SP(num_inference_steps=steps, seed=seed, true_cfg_scale=scale, **IMAGE_SIZE)
    return OmniDiffusionRequest(data, sp, rid)


def pixels(output) -> np.ndarray:
    value = output.output
    return np.asarray(value["video"] if isinstance(value, dict) else value, dtype=np.float64)


def solo(pipe, request: OmniDiffusionRequest) -> np.ndarray:
    with torch.inference_mode():
        (out,) = pipe.forward(DiffusionRequestBatch([request]))
    assert out.error is None, out.error
    return pixels(out)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    peak = 255.0 if max(a.max(), b.max()) > 1.5 else 1.0
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(peak**2 / mse)


def assert_parity(pipe, harness: Harness, requests: list[OmniDiffusionRequest]) -> list[float]:
    values = []
    for request in requests:
        out = harness.outputs[request.request_id]
        assert out.error is None, f"{request.request_id}: {out.error}"
        got, expected = pixels(out), solo(pipe, request)
        assert got.shape == expected.shape and expected.std() > 0
        values.append(psnr(got, expected))
    print(f"PSNR dB: {values}")  # inf = bitwise
    assert min(values) >= 60.0, values
    return values


@pytest.mark.parametrize("name", [name for name in FAMILIES if name != "wan2.2-t2v-a14b"])  # A14B: below
def test_cobatched_requests_match_request_mode_alone(logged, name):
    pipe, log = logged(name)
    harness = Harness(pipe, max_num_seqs=2)
    a = make(name, "a", steps=4, seed=1, prompt=PROMPTS[0], cfg=True, scale=4.0)
    b = make(name, "b", steps=2, seed=2, prompt=PROMPTS[1], cfg=False)
    c = make(name, "c", steps=2, seed=3, prompt=PROMPTS[2], cfg=True, scale=2.5)
    harness.add(a)
    harness.round()  # a alone
    harness.add(b)  # joins at step 1 of a, leaves after two steps
    harness.add(c)  # waits for b's slot, then joins a at its step 3, outlives it
    harness.drain()
    assert harness.finished_at == {"b": 3, "a": 4, "c": 5}
    assert log.sizes == [1, 2, 2, 2, 1]  # every step of every request ran once, shared where two were resident
    assert_parity(pipe, harness, [a, b, c])


def test_wan22_a14b_batches_hold_one_expert(logged):
    pipe, log = logged("wan2.2-t2v-a14b")
    harness = Harness(pipe, max_num_seqs=2)
    # Timesteps 4 steps: 999 973 923 | 800, 3 steps: 999 960 | 857 (high-noise expert down to 875).
    a = make("wan2.2-t2v-a14b", "a", steps=4, seed=1, prompt=PROMPTS[0], cfg=True)
    b = make("wan2.2-t2v-a14b", "b", steps=3, seed=2, prompt=PROMPTS[1], cfg=True, scale=3.0)
    harness.add(a)
    harness.add(b)
    harness.drain()
    # (a0 b0) and (a1 b1) together on the high-noise expert; a2 (high) apart from b2 (low); a3 (low) alone.
    assert log.sizes == [2, 2, 1, 1, 1] and log.experts == [True, True, True, False, False]
    assert harness.finished_at == {"b": 3, "a": 4}  # b left early, a went on alone
    assert_parity(pipe, harness, [a, b])


def test_token_cap_splits_a_group_and_cap_one_is_per_state(pipes, logged):
    pipe, log = logged("qwen-image")
    requests = [make("qwen-image", f"r{i}", steps=2, seed=i, prompt=PROMPTS[i], cfg=i != 1) for i in range(3)]
    with torch.inference_mode():
        tokens = [pipe.step_tokens(pipe.prepare([r], None)) for r in requests]
    harness = Harness(pipe, max_num_seqs=3, diffusion_max_tokens_per_forward=tokens[0] + tokens[1])
    for request in requests:
        harness.add(request)
    harness.drain()
    assert log.sizes == [2, 1] * 2  # r0 + r1 fit under the cap, r2 goes in a second forward
    assert_parity(pipe, harness, requests)
    log.sizes.clear()
    per_state = Harness(pipe, max_num_seqs=3, diffusion_max_tokens_per_forward=1)
    for request in requests:
        per_state.add(request)
    per_state.drain()
    assert log.sizes == [1] * 6
    for request in requests:  # the request-mode arithmetic exactly
        np.testing.assert_array_equal(pixels(per_state.outputs[request.request_id]), solo(pipe, request))


def test_split_by_tokens():
    members = [("a", 4), ("b", 4), ("c", 9), ("d", 1)]
    assert split_by_tokens(members, None) == [["a", "b", "c", "d"]]
    assert split_by_tokens(members, 8) == [["a", "b"], ["c"], ["d"]]
    assert split_by_tokens(members, 1) == [["a"], ["b"], ["c"], ["d"]]


@pytest.mark.parametrize("name", ["qwen-image", "wan2.1-t2v"])
def test_a_fault_inside_a_cobatched_forward_retires_only_its_request(logged, name):
    """The shared forward raises (the faulty request's rows make it fail), so each state of that forward
    retries the step with a forward of its own and only the faulty one fails. (A request whose own inputs
    raise, mark FAIL, is `test_step_execution.py::test_a_failing_request_is_retired_alone`, co-batched too.)"""
    pipe, log = logged(name)
    harness = Harness(pipe, max_num_seqs=3)
    others = [make(name, "x", steps=3, seed=1, prompt=PROMPTS[0], cfg=True),
              make(name, "y", steps=4, seed=2, prompt=PROMPTS[2], cfg=False)]
    harness.add(others[0])
    harness.add(make(name, "bad", steps=4, seed=3, prompt="CRASH here", cfg=True))
    harness.add(others[1])
    harness.round()
    harness.round()  # step 1 of "bad" fails
    bad = harness.outputs["bad"]
    assert bad.error_status_code == 500 and "injected forward fault" in bad.error
    assert [job.request.request_id for job in harness.executor.resident] == ["x", "y"]
    harness.drain()
    # Batched before and after the fault; the crashed forward is retried state by state (bad fails again).
    assert log.sizes == [3, 3, 1, 1, 1, 2, 1]
    assert_parity(pipe, harness, others)
