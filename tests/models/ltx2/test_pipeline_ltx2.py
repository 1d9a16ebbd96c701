"""Our LTX-2 pipeline vs diffusers' LTX2Pipeline on the same tiny weights and seed (issue 28).

Why it matters: the acceptance bar for native LTX-2: decoded frames within PSNR >= 35 dB and the waveform within
SNR >= 40 dB of diffusers, with CFG rows and two requests batched into one DiT forward; the step contract
(step-mode co-batched == solo) and the cache contract (quality=lossless is bitwise the uncached path); the
two-stage variant as diffusers' recipe runs it, its distilled LoRA on the refine pass only.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

SIZE = dict(height=32, width=64, num_frames=9, num_inference_steps=3, max_sequence_length=32)
# diffusers' CFG-only configuration: what our pipeline runs.
CFG_ONLY = dict(
    stg_scale=0.0,
    audio_stg_scale=0.0,
    modality_scale=1.0,
    audio_modality_scale=1.0,
    guidance_rescale=0.0,
    audio_guidance_rescale=0.0,
)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def snr(signal: np.ndarray, reference: np.ndarray) -> float:
    noise = np.sum((signal.astype(np.float64) - reference.astype(np.float64)) ** 2)
    return float("inf") if noise == 0 else 10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / noise)


def reference(pipe, prompt: str, seed: int, guidance: float, fps: int, negative: str | None = None):
    out = pipe(
        prompt=prompt,
        negative_prompt=negative,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
        guidance_scale=guidance,
        audio_guidance_scale=guidance,
        frame_rate=float(fps),
        **SIZE,
        **CFG_ONLY,
    )
    return (out.frames[0] * 255).round().astype(np.uint8), out.audio[0].float().numpy()


def request(prompt, seed: int, rid: str, **params) -> OmniDiffusionRequest:
    sp = OmniDiffusionSamplingParams(seed=seed, **{**SIZE, **params})
    return OmniDiffusionRequest(prompt=prompt, sampling_params=sp, request_id=rid)


@pytest.fixture(scope="module")
def ltx2(dist_world, ltx2_dir):
    from diffusers import LTX2Pipeline as RefPipeline

    from vllm_omni.models.ltx2.pipeline import LTX2Pipeline

    ours = LTX2Pipeline.from_pretrained(
        OmniDiffusionConfig(model=str(ltx2_dir)), ltx2_dir, torch.device("cpu"), torch.float32
    )
    ref = RefPipeline.from_pretrained(ltx2_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    return ours, ref


@pytest.fixture(scope="module")
def ltx2_lora(dist_world, ltx2_dir):
    """Ours with LoRA on (`--enable-lora`): two_stage's refine pass runs the checkpoint's distilled LoRA."""
    from vllm_omni.models.ltx2.pipeline import LTX2Pipeline

    return LTX2Pipeline.from_pretrained(
        OmniDiffusionConfig(model=str(ltx2_dir), enable_lora=True), ltx2_dir, torch.device("cpu"), torch.float32
    )


def test_batched_cfg_matches_diffusers(ltx2):
    ours, ref = ltx2
    items = [("A cat walks on the grass while birds sing.", 7), ("Ocean waves crash against the rocks.", 11)]
    outputs = ours.forward(
        DiffusionRequestBatch([request(p, s, f"r{i}", guidance_scale=3.0, fps=24) for i, (p, s) in enumerate(items)])
    )
    for (prompt, seed), out in zip(items, outputs, strict=True):
        assert out.error is None
        video, audio = out.output["video"], out.output["audio"]
        assert video.dtype == np.uint8 and video.shape == (9, 32, 64, 3) and out.output["fps"] == 24
        assert out.output["sample_rate"] == 16000 and audio.dtype == np.float32 and audio.shape[0] == 2
        expected_video, expected_audio = reference(ref, prompt, seed, 3.0, 24)
        assert audio.shape == expected_audio.shape
        assert video.std() > 1.0 and np.abs(audio).max() > 1e-3, "a constant output would prove nothing"
        assert psnr(video, expected_video) >= 35.0
        assert snr(audio, expected_audio) >= 40.0
    assert psnr(outputs[0].output["video"], outputs[1].output["video"]) < 30.0, "different prompts/seeds differ"


def test_negative_prompt_outputs_per_prompt_and_fps(ltx2):
    ours, ref = ltx2
    rq = request(
        {"prompt": "A dog barks and runs.", "negative_prompt": "blurry"},
        3,
        "neg",
        guidance_scale=4.0,
        num_outputs_per_prompt=2,
        fps=12,
    )
    (out,) = ours.forward(DiffusionRequestBatch([rq]))
    assert out.output["video"].shape == (2, 9, 32, 64, 3) and out.output["fps"] == 12
    expected = ref(
        prompt="A dog barks and runs.",
        negative_prompt="blurry",
        num_videos_per_prompt=2,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="np",
        guidance_scale=4.0,
        audio_guidance_scale=4.0,
        frame_rate=12.0,
        **SIZE,
        **CFG_ONLY,
    )
    assert psnr(out.output["video"], (expected.frames * 255).round().astype(np.uint8)) >= 35.0
    assert snr(out.output["audio"], expected.audio.float().numpy()) >= 40.0
    # 12 fps: the same 9 frames last twice as long, so the soundtrack has twice the latent frames.
    assert (
        out.output["audio"].shape[-1]
        > 1.5
        * ours.forward(DiffusionRequestBatch([request("A dog barks.", 3, "fps24", fps=24)]))[0]
        .output["audio"]
        .shape[-1]
    )


def test_invalid_requests_fail_alone(ltx2):
    ours, _ = ltx2
    good = request("A red car.", 1, "good")
    outs = ours.forward(
        DiffusionRequestBatch(
            [
                request("   ", 1, "bad"),
                good,
                request("x", 1, "odd", height=33),
                request("x", 1, "g2", guidance_scale_2=2.0),
                request("x", 1, "half", two_stage=True),  # 32x64: the base pass would be 16x32
            ]
        )
    )
    assert outs[0].error_status_code == 400 and "prompt" in outs[0].error
    assert outs[1].error is None and outs[1].output["video"].shape == (9, 32, 64, 3)
    assert outs[2].error_status_code == 400 and "height" in outs[2].error
    assert outs[3].error_status_code == 400 and "guidance_scale_2" in outs[3].error
    assert outs[4].error_status_code == 400 and "height must be a multiple of 64" in outs[4].error
    with pytest.raises(OmniClientError) as bad:
        OmniDiffusionSamplingParams(two_stage="yes")
    assert bad.value.param == "two_stage"


def test_step_mode_cobatched_requests_equal_their_solo_outputs(ltx2):
    """max_num_seqs 4: different prompts, step counts, CFG on/off; one of another frame count (its own forward).
    They join mid-flight; each ends with its solo frames and waveform."""
    ours, _ = ltx2
    reqs = [
        request("A cat walks on the grass.", 1, "a", guidance_scale=3.0),
        request("A dog barks.", 2, "b", num_inference_steps=2, guidance_scale=1.0),
        request("Waves crash.", 3, "c", num_inference_steps=2, num_frames=5, guidance_scale=1.0),
    ]
    _, forwards = check_step_mode_equals_solo(ours, reqs)
    assert max(forwards) == 2  # a and b shared forwards; c (other frame count) never joined them


def check_step_mode_equals_solo(ours, reqs: list[OmniDiffusionRequest]) -> tuple[dict[str, Any], list[int]]:
    """`reqs` stepped together (the first alone for a round) each end with their solo frames and waveform; (their
    outputs by id, the input counts of every forward)."""
    from tests.models.image_checks import step_cobatched

    outputs, forwards = step_cobatched(ours, reqs)
    for req in reqs:
        (solo,) = ours.forward(DiffusionRequestBatch([req]))
        assert psnr(outputs[req.request_id].output["video"], solo.output["video"]) >= 60.0
        assert snr(outputs[req.request_id].output["audio"], solo.output["audio"]) >= 60.0
    return outputs, forwards


def test_lossless_is_bitwise_uncached_and_high_reuses_steps(ltx2, ltx2_dir):
    from vllm_omni.models.ltx2.pipeline import LTX2Pipeline

    ours, _ = ltx2
    cached = LTX2Pipeline.from_pretrained(
        OmniDiffusionConfig(model=str(ltx2_dir), cache_backend="tea_cache"),
        ltx2_dir,
        torch.device("cpu"),
        torch.float32,
    )
    params = dict(num_inference_steps=5, guidance_scale=3.0)
    (plain,) = ours.forward(DiffusionRequestBatch([request("A cat walks.", 5, "p", **params)]))
    (lossless,) = cached.forward(DiffusionRequestBatch([request("A cat walks.", 5, "l", quality="lossless", **params)]))
    np.testing.assert_array_equal(lossless.output["video"], plain.output["video"])
    np.testing.assert_array_equal(lossless.output["audio"], plain.output["audio"])
    (high,) = cached.forward(DiffusionRequestBatch([request("A cat walks.", 5, "h", quality="high", **params)]))
    info = high.extra["cache"]
    assert (info["backend"], info["computed_steps"], info["reused_steps"]) == ("tea_cache", 4, 1)
    assert not np.array_equal(high.output["audio"], plain.output["audio"])
    assert psnr(high.output["video"], plain.output["video"]) > 15.0


def test_image_to_video_matches_diffusers(ltx2, ltx2_dir):
    """A request with an image is image-to-video (diffusers' LTX2ImageToVideoPipeline on the same checkpoint):
    the first latent frame holds the image and stays clean."""
    from diffusers import LTX2ImageToVideoPipeline
    from PIL import Image

    ours, _ = ltx2
    ref = LTX2ImageToVideoPipeline.from_pretrained(ltx2_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    gradient = np.linspace(0, 255, 64 * 32 * 3).reshape(32, 64, 3).astype(np.uint8)
    image = Image.fromarray(gradient)
    prompt = {"prompt": "A cat walks on the grass.", "multi_modal_data": {"image": image}}
    (out,) = ours.forward(DiffusionRequestBatch([request(prompt, 5, "i2v", guidance_scale=3.0, fps=24)]))
    assert out.error is None, out.error
    expected = ref(
        image=image,
        prompt="A cat walks on the grass.",
        generator=torch.Generator("cpu").manual_seed(5),
        output_type="np",
        guidance_scale=3.0,
        audio_guidance_scale=3.0,
        frame_rate=24.0,
        **SIZE,
        **CFG_ONLY,
    )
    assert psnr(out.output["video"], (expected.frames[0] * 255).round().astype(np.uint8)) >= 35.0
    assert snr(out.output["audio"], expected.audio[0].float().numpy()) >= 40.0
    (t2v,) = ours.forward(DiffusionRequestBatch([request("A cat walks on the grass.", 5, "t2v", guidance_scale=3.0)]))
    assert psnr(out.output["video"], t2v.output["video"]) < 30.0, "the image must condition the clip"


def test_two_stage_matches_diffusers_recipe(ltx2, ltx2_lora, ltx2_dir):
    """`two_stage=True` at 64x128: the base pass at 32x64 (CFG), the x2 latent upsampler, 3 refine steps at
    64x128 with the checkpoint's distilled LoRA; frames and waveform match diffusers' two-stage recipe on the same
    weights and seed (`load_lora_weights(repo, adapter_name="stage_2_distilled", weight_name=...)` before
    stage 2)."""
    from vllm_omni.models.ltx2.pipeline import DISTILLED_LORA

    _, ref = ltx2
    prompt = "A man plays a red electric guitar on a stage, the crowd cheers."
    rq = request(prompt, 9, "two", guidance_scale=3.0, fps=24, height=64, width=128, two_stage=True)
    (out,) = ltx2_lora.forward(DiffusionRequestBatch([rq]))
    assert out.error is None, out.error
    video, audio = out.output["video"], out.output["audio"]
    assert video.shape == (9, 64, 128, 3)
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks" / "diffusion"))
    from bench_ltx2 import diffusers_two_stage
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

    # diffusers' recipe with the checkpoint's upsampler as its docs load it (from_pretrained, subfolder).
    upsampler = LTX2LatentUpsamplerModel.from_pretrained(ltx2_dir, subfolder="latent_upsampler", dtype=torch.float32)
    params = dict(SIZE, height=64, width=128, guidance_scale=3.0, fps=24)
    expected = diffusers_two_stage(ref, upsampler, params, prompt, 9, distilled_lora=ltx2_dir / DISTILLED_LORA)
    expected_video = (expected.frames[0] * 255).round().astype(np.uint8)
    expected_audio = expected.audio[0].float().numpy()
    assert video.std() > 1.0 and np.abs(audio).max() > 1e-3, "a constant output would prove nothing"
    assert audio.shape == expected_audio.shape
    assert psnr(video, expected_video) >= 35.0
    assert snr(audio, expected_audio) >= 40.0
    without = diffusers_two_stage(ref, upsampler, params, prompt, 9)  # the recipe without its LoRA misses both bars
    assert psnr(video, (without.frames[0] * 255).round().astype(np.uint8)) < 35.0
    assert snr(audio, without.audio[0].float().numpy()) < 40.0
    (one,) = ltx2_lora.forward(
        DiffusionRequestBatch([request(prompt, 9, "one", guidance_scale=3.0, height=64, width=128)])
    )
    assert psnr(video, one.output["video"]) < 30.0, "the two passes are not the one-stage run"


def test_distilled_lora_runs_on_the_refine_steps_only(ltx2, ltx2_lora, ltx2_dir, monkeypatch):
    """The base pass's latents are those of the run without LoRA; the refine pass's adapter changes the clip;
    `refine_lora` overrides the checkpoint's file (here: the same file at scale 0 is the run without it)."""
    from vllm_omni.models.ltx2.pipeline import DISTILLED_LORA, LTX2Pipeline

    plain, _ = ltx2
    base_latents = []
    start_refine = LTX2Pipeline.start_refine

    def record(self, state, latents):
        base_latents.append(latents.clone())
        return start_refine(self, state, latents)

    monkeypatch.setattr(LTX2Pipeline, "start_refine", record)
    params = dict(guidance_scale=3.0, height=64, width=128, num_frames=5, num_inference_steps=2, two_stage=True)
    off = {"path": str(ltx2_dir / DISTILLED_LORA), "scale": 0.0}
    (with_lora,) = ltx2_lora.forward(DiffusionRequestBatch([request("A dog barks.", 4, "lora", **params)]))
    (without,) = plain.forward(DiffusionRequestBatch([request("A dog barks.", 4, "plain", **params)]))
    (scale_0,) = ltx2_lora.forward(DiffusionRequestBatch([request("A dog barks.", 4, "s0", refine_lora=off, **params)]))
    assert len(base_latents) == 3
    torch.testing.assert_close(base_latents[0], base_latents[1], rtol=1e-5, atol=1e-5)
    assert psnr(with_lora.output["video"], without.output["video"]) < 30.0, "the refine pass runs the adapter"
    assert snr(with_lora.output["audio"], without.output["audio"]) < 40.0
    assert psnr(scale_0.output["video"], without.output["video"]) >= 60.0
    assert snr(scale_0.output["audio"], without.output["audio"]) >= 60.0


def test_refine_lora_bad_input_fails_alone(ltx2, ltx2_lora, ltx2_dir, tmp_path, monkeypatch):
    """400s naming `refine_lora` (or `lora`); the good request of the batch still runs."""
    from vllm_omni.diffusion.model_loader.tiny_lora import write_tiny_lora
    from vllm_omni.models.ltx2.pipeline import DISTILLED_LORA

    plain, _ = ltx2
    two = dict(height=64, width=128, num_frames=5, num_inference_steps=2, two_stage=True)
    style = {"path": str(write_tiny_lora(ltx2_dir, tmp_path / "style.safetensors", rank=4))}
    file = {"path": str(ltx2_dir / DISTILLED_LORA)}
    outs = ltx2_lora.forward(
        DiffusionRequestBatch(
            [
                request("x", 1, "no_two_stage", refine_lora=file),
                request("x", 1, "missing", refine_lora={"path": str(tmp_path / "nope.safetensors")}, **two),
                request("x", 1, "two_loras", lora=style, **two),  # --max-loras 1: lora + the refine adapter
                request("x", 1, "good", **two),
            ]
        )
    )
    for out, words in zip(outs[:3], ["set two_stage", "cannot read", "--max-loras"], strict=True):
        assert out.error_status_code == 400 and out.error_param == "refine_lora" and words in out.error, out.error
    assert outs[3].error is None and outs[3].output["video"].shape == (5, 64, 128, 3)
    (off,) = plain.forward(DiffusionRequestBatch([request("x", 1, "off", refine_lora=file, **two)]))
    assert off.error_param == "refine_lora" and "--enable-lora" in off.error
    monkeypatch.setattr(ltx2_lora, "distilled_lora", None)  # a checkpoint without the file
    (none,) = ltx2_lora.forward(DiffusionRequestBatch([request("x", 1, "none", **two)]))
    assert none.error_param == "refine_lora" and DISTILLED_LORA in none.error
    with pytest.raises(OmniClientError) as bad:
        OmniDiffusionSamplingParams(refine_lora=[file])
    assert bad.value.param == "refine_lora"


def test_two_stage_step_mode_cobatched_equals_solo(ltx2_lora):
    """Step mode: two two-stage requests join mid-flight (one a step behind, so they cross the pass switch apart)
    and a one-stage request of the refine pass's size; they share forwards where their passes' shapes agree (the
    refine rows with the distilled adapter, the one-stage rows without), and each ends with its solo output."""
    ours = ltx2_lora
    big = dict(height=64, width=128, num_frames=5, guidance_scale=3.0)
    reqs = [
        request("A cat walks on the grass.", 1, "a", two_stage=True, num_inference_steps=2, **big),
        request("A dog barks.", 2, "b", two_stage=True, num_inference_steps=2, **big),
        request("Waves crash.", 3, "c", num_inference_steps=2, **{**big, "guidance_scale": 1.0}),
    ]
    outputs, forwards = check_step_mode_equals_solo(ours, reqs)
    assert max(forwards) >= 2, "the refine passes (no CFG, full size) co-batch with the one-stage request"
    assert all(out.output["video"].shape == (5, 64, 128, 3) for out in outputs.values())
