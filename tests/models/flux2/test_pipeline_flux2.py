"""Native FLUX.2 [klein] vs diffusers on the same tiny checkpoints (fp32, CPU, in this process).

Pins: our MMDiT computes diffusers' function from diffusers' weights (fused q/k/v, packed SwiGLU and single-block
projections, shared modulation, 4-axis RoPE); the pipeline gives diffusers' images for the same seeds on the
step-distilled repo (no CFG) and the base repo (CFG against ""); a bare request runs the checkpoint's defaults
(distilled: 4 steps, no CFG; base: 50 steps, CFG 4); guidance on a distilled repo is refused, not ignored; step
mode co-batches requests of different prompts, step counts and CFG and each ends with its solo output;
`quality="lossless"` is bitwise the uncached output and `high` reuses the steps of its schedule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.diffusion.step_harness import Harness
from tests.models.image_checks import check_lossless_and_high, cobatched_forwards, psnr, run
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

pytestmark = pytest.mark.usefixtures("dist_world")
CPU = torch.device("cpu")
PROMPTS = ["a photo of a cat sitting on a red chair", "the quick brown fox", "mountains and a lake at dawn"]
SIZE = {"height": 32, "width": 48, "max_sequence_length": 48}


def load(model_dir, **config):
    from vllm_omni.models.flux2.pipeline import Flux2KleinPipeline

    od_config = OmniDiffusionConfig(model=str(model_dir), **config)
    return Flux2KleinPipeline.from_pretrained(od_config, model_dir, CPU, torch.float32)


@pytest.fixture(scope="module")
def pipes(klein_dir, klein_base_dir):
    return {"distilled": load(klein_dir), "base": load(klein_base_dir)}


@pytest.fixture(scope="module")
def references(klein_dir, klein_base_dir):
    from diffusers import Flux2KleinPipeline

    out = {}
    for name, model_dir in (("distilled", klein_dir), ("base", klein_base_dir)):
        out[name] = Flux2KleinPipeline.from_pretrained(model_dir, dtype=torch.float32)
        out[name].set_progress_bar_config(disable=True)
    return out


def request(
    prompt: str, seed: int, rid: str | None = None, negative: str | None = None, **params
) -> OmniDiffusionRequest:
    params = {**SIZE, "num_inference_steps": 3, "output_type": "np", **params}
    return OmniDiffusionRequest(
        {"prompt": prompt, "negative_prompt": negative}, SP(seed=seed, **params), rid or f"r{seed}"
    )


def test_transformer_matches_diffusers(pipes, references):
    ours, ref = pipes["distilled"].transformer, references["distilled"].transformer
    torch.manual_seed(0)
    x, enc = torch.randn(2, 24, ref.config.in_channels), torch.randn(2, 7, ref.config.joint_attention_dim)
    t = torch.tensor([0.3, 0.8])
    img_ids = torch.stack([torch.zeros(24), torch.arange(24) // 6, torch.arange(24) % 6, torch.zeros(24)], dim=1)
    txt_ids = torch.zeros(7, 4)
    txt_ids[:, 3] = torch.arange(7)
    with torch.inference_mode():
        want = ref(
            hidden_states=x,
            encoder_hidden_states=enc,
            timestep=t,
            img_ids=img_ids[None],
            txt_ids=txt_ids[None],
            return_dict=False,
        )[0]
        got = ours(x, enc, t, img_ids=img_ids, txt_ids=txt_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["distilled", "base"])
def test_batched_requests_match_diffusers(pipes, references, name):
    """Distilled: no CFG; base: CFG 2.5 against the empty prompt, positive and negative rows in one forward."""
    extra = {"guidance_scale": 2.5} if name == "base" else {}
    reqs = [request(p, 10 + i, **extra) for i, p in enumerate(PROMPTS[:2])]
    outputs = pipes[name].forward(DiffusionRequestBatch(reqs))
    for req, out in zip(reqs, outputs, strict=True):
        assert out.error is None, out.error
        want = references[name](
            prompt=req.prompt_text,
            num_inference_steps=3,
            output_type="np",
            guidance_scale=extra.get("guidance_scale", 1.0),
            **SIZE,
            generator=torch.Generator().manual_seed(req.sampling_params.seed),
        ).images[0]
        assert want.std() > 0.01
        assert psnr(out.output[0] * 255, want * 255) >= 40.0
    assert psnr(outputs[0].output[0] * 255, outputs[1].output[0] * 255) < 30.0


@pytest.mark.parametrize("name, steps, cfg", [("distilled", 4, False), ("base", 50, True)])
def test_a_bare_request_runs_the_checkpoints_defaults(pipes, name, steps, cfg):
    with torch.inference_mode():
        state = pipes[name].prepare([OmniDiffusionRequest("a red cube", SP(seed=0), "bare")], None)
    assert len(state.timesteps) == steps and state.conditioning.do_cfg is cfg
    assert (state.conditioning.lh, state.conditioning.lw) == (64, 64)  # 1024^2: 16x VAE + 2x2 patches
    assert state.conditioning.embeds.shape[1] == 512


@pytest.mark.parametrize(
    "params, field",
    [
        ({"guidance_scale": 4.0}, "guidance_scale"),
        ({"true_cfg_scale": 4.0}, "true_cfg_scale"),
        ({"negative": "blurry"}, "negative_prompt"),
    ],
)
def test_a_parameter_the_checkpoint_would_not_use_is_refused(pipes, params, field):
    bad, good = request("a cat", 1, "bad", **params), request("a cat", 2, "good")
    out_bad, out_good = pipes["distilled"].forward(DiffusionRequestBatch([bad, good]))
    assert out_good.error is None and out_bad.error_status_code == 400 and field in out_bad.error


def test_step_mode_cobatched_requests_equal_their_solo_outputs(pipes):
    """max_num_seqs 4 on the base repo: different prompts, step counts, CFG on/off and scales share forwards; one
    of another size runs apart; they join and leave mid-flight."""
    reqs = [
        request(PROMPTS[0], 1, "a", num_inference_steps=4, guidance_scale=4.0),
        request(PROMPTS[1], 2, "b", num_inference_steps=2, guidance_scale=1.0),
        request(PROMPTS[2], 3, "c", num_inference_steps=3, guidance_scale=2.5),
        request(PROMPTS[1], 4, "d", num_inference_steps=2, height=48, width=32),
    ]
    forwards = cobatched_forwards(pipes["base"], reqs)
    assert max(forwards) == 3  # a, b and c shared forwards; d (another size) never joined them


def test_lossless_is_bitwise_uncached_and_high_reuses_steps(pipes, klein_dir):
    cached = load(klein_dir, cache_backend="tea_cache")
    check_lossless_and_high(
        pipes["distilled"], cached, lambda **params: request(PROMPTS[0], 5, num_inference_steps=5, **params)
    )


def image(seed: int, size=(80, 64)):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_reference_images_match_diffusers(pipes, references):
    """Two reference images of different sizes, no output size given (the first image's), base repo with CFG."""
    refs = [image(1), image(2, (64, 96))]
    req = OmniDiffusionRequest(
        {"prompt": PROMPTS[0], "multi_modal_data": {"image": refs}},
        SP(seed=3, num_inference_steps=3, guidance_scale=3.0, output_type="np", max_sequence_length=48),
        "edit",
    )
    out = run(pipes["base"], req)
    want = references["base"](
        image=refs,
        prompt=PROMPTS[0],
        num_inference_steps=3,
        guidance_scale=3.0,
        output_type="np",
        max_sequence_length=48,
        generator=torch.Generator().manual_seed(3),
    ).images[0]
    assert out.output[0].shape == want.shape == (64, 80, 3)
    assert psnr(out.output[0] * 255, want * 255) >= 40.0
    plain = run(pipes["base"], request(PROMPTS[0], 3, guidance_scale=3.0, height=64, width=80))
    assert psnr(plain.output[0] * 255, out.output[0] * 255) < 70.0  # the references reached the DiT (~50 dB here)


@pytest.fixture(scope="module")
def dev(dist_world):
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("flux2-dev")


def test_dev_matches_diffusers_and_defaults_to_embedded_guidance(dev):
    """FLUX.2 [dev]: Mistral-3 prompt encoding under the system message, guidance embedded per row (two requests
    with different guidance share one forward in step mode), diffusers' defaults (50 steps, guidance 4)."""
    import diffusers
    from transformers import AutoTokenizer, Mistral3ForConditionalGeneration

    from vllm_omni.models.flux2.pipeline_dev import Flux2Pipeline

    ours = Flux2Pipeline.from_pretrained(OmniDiffusionConfig(model=str(dev)), dev, CPU, torch.float32)
    # diffusers loads tokenizer/ as a PixtralProcessor, which needs torchvision: hand it the processor's tokenizer.
    ref = diffusers.Flux2Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(dev / "scheduler"),
        vae=diffusers.AutoencoderKLFlux2.from_pretrained(dev / "vae"),
        text_encoder=Mistral3ForConditionalGeneration.from_pretrained(dev / "text_encoder"),
        tokenizer=AutoTokenizer.from_pretrained(dev / "tokenizer"),
        transformer=diffusers.Flux2Transformer2DModel.from_pretrained(dev / "transformer"),
    )
    ref.set_progress_bar_config(disable=True)
    reqs = [request(PROMPTS[0], 1, "a", guidance_scale=3.0), request(PROMPTS[1], 2, "b", guidance_scale=5.0)]
    harness = Harness(ours, max_num_seqs=2)
    for req in reqs:
        harness.add(req)
    harness.drain()
    for req in reqs:
        out = harness.outputs[req.request_id]
        assert out.error is None, out.error
        want = ref(
            prompt=req.prompt_text,
            num_inference_steps=3,
            guidance_scale=req.sampling_params.guidance_scale,
            output_type="np",
            **SIZE,
            generator=torch.Generator().manual_seed(req.sampling_params.seed),
        ).images[0]
        assert want.std() > 0.01 and psnr(out.output[0] * 255, want * 255) >= 40.0
    with torch.inference_mode():
        state = ours.prepare([OmniDiffusionRequest("a red cube", SP(seed=0), "bare")], None)
    assert len(state.timesteps) == 50 and not state.conditioning.do_cfg and state.conditioning.guidance == 4.0
    (refused,) = ours.forward(
        DiffusionRequestBatch(
            [
                OmniDiffusionRequest(
                    {"prompt": "a cat", "negative_prompt": "blurry"}, SP(**SIZE, num_inference_steps=1), "neg"
                )
            ]
        )
    )
    assert refused.error_status_code == 400 and "negative_prompt" in refused.error
