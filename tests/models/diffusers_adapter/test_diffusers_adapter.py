"""The generic diffusers adapter, end to end: real worker process, real diffusers pipeline, tiny weights.

What it pins: through our runtime a diffusers pipeline gives exactly the pixels plain diffusers gives with
the same seed (single and multiple outputs per prompt); a parameter the pipeline does not accept is a 422
naming it; the engine reports the model's class and modality; audio outputs are converted for the audio
encoders, and what cannot be converted is refused at load.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import DanceDiffusionPipeline

from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

MODEL = "tiny/qwen-image"
PROMPT = {"prompt": "a cat holding a sign that says hello world", "negative_prompt": "blurry"}
COMMON = {"height": 64, "width": 64, "num_inference_steps": 4, "true_cfg_scale": 4.0}


@pytest.fixture(scope="module")
def engine():
    engine = DiffusionEngine(OmniDiffusionConfig(model=MODEL, use_diffusers_adapter=True))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference():
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(build_tiny(MODEL), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_adapter_matches_diffusers_exactly(engine, reference):
    out = engine.submit(OmniDiffusionRequest(PROMPT, SP(seed=42, **COMMON), "same-seed")).result(120)
    assert out.error is None, out.error
    expected = reference(**PROMPT, **COMMON, generator=torch.Generator("cpu").manual_seed(42)).images
    assert len(out.output) == 1 and out.output[0].size == (64, 64)
    assert np.array_equal(np.asarray(out.output[0]), np.asarray(expected[0]))
    assert {"pipeline", "forward", "queue"} <= set(out.stage_durations)


def test_adapter_multiple_outputs_per_prompt(engine, reference):
    sp = SP(seed=7, num_outputs_per_prompt=2, **COMMON)
    out = engine.submit(OmniDiffusionRequest(PROMPT, sp, "two-images")).result(120)
    expected = reference(**PROMPT, **COMMON, num_images_per_prompt=2,
                         generator=torch.Generator("cpu").manual_seed(7)).images
    assert len(out.output) == 2
    for got, want in zip(out.output, expected, strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want))


def test_unsupported_parameter_is_422_naming_it(engine):
    out = engine.submit(OmniDiffusionRequest("a cat", SP(num_frames=8, **COMMON), "bad-param")).result(120)
    assert out.error_status_code == 422 and "num_frames" in out.error
    ok = engine.submit(OmniDiffusionRequest("a cat", SP(seed=1, **COMMON), "after-bad")).result(120)
    assert ok.error is None


def test_engine_metadata(engine):
    assert engine.model_class_name == "QwenImagePipeline"
    assert engine.output_modality == "image" and not engine.supports_request_batch


def test_adapter_progress_and_abort_through_step_callback(reference):
    """Through diffusers' public `callback_on_step_end`: progress for every step; a request aborted during step 2
    stops there (no VAE decode), one aborted before it starts never runs; the next request is unaffected."""
    from vllm_omni.diffusion.step_context import StepContext
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
    from vllm_omni.models.diffusers_adapter.pipeline import DiffusersAdapterPipeline

    od_config = OmniDiffusionConfig(model=MODEL, use_diffusers_adapter=True)
    adapter = DiffusersAdapterPipeline(reference, od_config)
    steps: list[tuple[str, int]] = []
    aborted = {"never"}

    def sink(request_id: str, kind: str, data: dict) -> None:
        steps.append((request_id, data["step"]))
        if request_id == "stop" and data["step"] == 2:
            aborted.add(request_id)

    decodes = []
    decode = reference.vae.decode
    reference.vae.decode = lambda *a, **k: decodes.append(1) or decode(*a, **k)
    requests = [OmniDiffusionRequest(PROMPT, SP(seed=seed, **COMMON), rid)
                for seed, rid in enumerate(("never", "stop", "ok"))]
    ctx = StepContext(od_config, request_ids=[r.request_id for r in requests], partial_sink=sink,
                      abort_requested=aborted.__contains__)
    try:
        never, stop, ok = adapter.forward(DiffusionRequestBatch(requests), ctx)
    finally:
        del reference.vae.decode
    for out in (never, stop):
        assert (out.error, out.error_status_code, out.error_type) == ("request aborted", 499, "aborted")
    assert steps == [("stop", 1), ("stop", 2)] + [("ok", s) for s in range(1, COMMON["num_inference_steps"] + 1)]
    assert len(decodes) == 1
    expected = reference(**PROMPT, **COMMON, generator=torch.Generator("cpu").manual_seed(2)).images
    assert np.array_equal(np.asarray(ok.output[0]), np.asarray(expected[0]))


def _tiny_dance_unet(sample_rate: int | None = 16_000):
    from diffusers import UNet1DModel

    torch.manual_seed(0)
    return UNet1DModel(block_out_channels=(32, 32, 64), extra_in_channels=64, sample_size=128, sample_rate=sample_rate,
                       in_channels=2, out_channels=2, flip_sin_to_cos=True, use_timestep_embedding=False,
                       time_embedding_type="fourier", mid_block_type="UNetMidBlock1D",
                       down_block_types=("DownBlock1DNoSkip", "DownBlock1D", "AttnDownBlock1D"),
                       up_block_types=("AttnUpBlock1D", "UpBlock1D", "UpBlock1DNoSkip"))


def test_adapter_converts_audio_for_the_speech_encoders():
    """An `audios` pipeline (here diffusers' Dance Diffusion, real UNet1D and scheduler; a prompt-taking
    subclass, as the adapter's routes always send a prompt) answers one waveform with the rate its UNet declares,
    the shape the speech route's and chat's encoders take; it used to raise NotImplementedError (a 500)."""
    import io
    import wave

    from diffusers import IPNDMScheduler

    from vllm_omni.catalog.registry import MODEL_REGISTRY
    from vllm_omni.entrypoints.openai.media import encode_wav
    from vllm_omni.models.diffusers_adapter.pipeline import DiffusersAdapterPipeline

    assert MODEL_REGISTRY.output_modality("DanceDiffusionPipeline") == "audio"
    pipe = PromptedDanceDiffusion(unet=_tiny_dance_unet(), scheduler=IPNDMScheduler())
    pipe.set_progress_bar_config(disable=True)
    adapter = DiffusersAdapterPipeline(pipe, OmniDiffusionConfig(model="dance", use_diffusers_adapter=True))
    out = adapter._generate(OmniDiffusionRequest("a drum loop", SP(seed=3, num_inference_steps=2), "audio"), None)
    expected = DanceDiffusionPipeline.__call__(pipe, num_inference_steps=2,
                                               generator=torch.Generator("cpu").manual_seed(3)).audios
    assert out.output["sample_rate"] == 16_000
    assert out.output["audio"].shape == (2, 128) and np.array_equal(out.output["audio"], expected[0])
    with wave.open(io.BytesIO(encode_wav(out.output["audio"], out.output["sample_rate"]))) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getnframes()) == (16_000, 2, 128)
    with pytest.raises(OmniClientError, match="one waveform") as info:
        adapter.call_kwargs(OmniDiffusionRequest("x", SP(num_outputs_per_prompt=2), "two"))
    assert info.value.param == "num_outputs_per_prompt"
    for knob, value in (("two_stage", True), ("refine_lora", {"path": "/l.safetensors"})):  # LTX-2's: not dropped
        with pytest.raises(OmniClientError, match="no two-stage variant") as info:
            adapter.call_kwargs(OmniDiffusionRequest("x", SP(**{knob: value}), "two-stage"))
        assert info.value.param == knob


def test_adapter_refuses_at_load_what_it_cannot_convert():
    from diffusers import IPNDMScheduler

    from vllm_omni.models.diffusers_adapter.pipeline import DiffusersAdapterPipeline

    od = OmniDiffusionConfig(model="dance", use_diffusers_adapter=True)
    no_rate = PromptedDanceDiffusion(unet=_tiny_dance_unet(sample_rate=None), scheduler=IPNDMScheduler())
    with pytest.raises(ValueError, match="makes audio, but the adapter finds its sample rate in none of"):
        DiffusersAdapterPipeline(no_rate, od)
    with pytest.raises(ValueError, match=r"returns no declared output dataclass; .* converts \['frames'"):
        DiffusersAdapterPipeline(torch.nn.Identity(), od)


class PromptedDanceDiffusion(DanceDiffusionPipeline):
    """Dance Diffusion (unconditional) with the `prompt` argument the adapter always passes, ignored here."""

    def __call__(self, prompt=None, num_inference_steps=100, generator=None, output_type="np"):
        return super().__call__(num_inference_steps=num_inference_steps, generator=generator)
