"""Native Z-Image vs diffusers on the same tiny Z-Image-Turbo checkpoint (fp32, CPU, in this process).

Pins: our DiT computes diffusers' function from diffusers' weights (fused q/k/v and SwiGLU, pad tokens, per-row
RoPE after each row's padded prompt) for rows of different prompt lengths in one forward; the pipeline gives
diffusers' images for the same seeds with and without CFG; a bare request runs Z-Image-Turbo's distilled
defaults (9 steps, no CFG, 1024^2); step mode co-batches requests of different prompts, step counts and CFG
and each ends with its solo output; `quality="lossless"` is bitwise the uncached output and `high` reuses the
steps of its schedule.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.image_checks import check_lossless_and_high, cobatched_forwards, psnr, run
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

pytestmark = pytest.mark.usefixtures("dist_world")
CPU = torch.device("cpu")
PROMPTS = [
    "a photo of a cat sitting on a red chair",
    "the quick brown fox jumps over the lazy dog near the river",
    "mountains",
]


def load(model_dir, **config):
    from vllm_omni.models.z_image.pipeline import ZImagePipeline

    return ZImagePipeline.from_pretrained(
        OmniDiffusionConfig(model=str(model_dir), **config), model_dir, CPU, torch.float32
    )


@pytest.fixture(scope="module")
def ours(z_image_dir):
    return load(z_image_dir)


@pytest.fixture(scope="module")
def reference(z_image_dir):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(z_image_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def request(
    prompt: str, seed: int, rid: str | None = None, negative: str | None = None, **params
) -> OmniDiffusionRequest:
    params = {"height": 32, "width": 48, "num_inference_steps": 3, "output_type": "np", **params}
    return OmniDiffusionRequest(
        {"prompt": prompt, "negative_prompt": negative}, SP(seed=seed, **params), rid or f"r{seed}"
    )


def test_transformer_matches_diffusers_on_rows_of_different_prompt_lengths(ours, reference):
    torch.manual_seed(0)
    dim = reference.transformer.config.cap_feat_dim
    latents = torch.randn(2, 16, 6, 10)  # 15 image tokens: padded to 32
    caps = [torch.randn(5, dim), torch.randn(40, dim)]  # padded to 32 and 64
    t = torch.tensor([0.3, 0.8])
    embeds = torch.zeros(2, 40, dim)
    embeds[0, :5], embeds[1] = caps
    with torch.inference_mode():
        want = reference.transformer(list(latents[:, :, None]), t, caps, return_dict=False)[0]
        got = ours.transformer(latents, t, embeds, (5, 40))
    torch.testing.assert_close(got, torch.stack(want)[:, :, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("guidance", [None, 3.0])
def test_batched_requests_match_diffusers(ours, reference, guidance):
    """Without CFG (Turbo's default) and with it (two prompts, default and given negative prompts)."""
    negatives = [None, "blurry"] if guidance else [None, None]
    extra = {} if guidance is None else {"guidance_scale": guidance}
    pairs = enumerate(zip(PROMPTS[:2], negatives, strict=True))
    reqs = [request(p, 10 + i, negative=n, **extra) for i, (p, n) in pairs]
    outputs = ours.forward(DiffusionRequestBatch(reqs))
    for req, out in zip(reqs, outputs, strict=True):
        assert out.error is None, out.error
        want = reference(
            prompt=req.prompt_text,
            negative_prompt=req.negative_prompt,
            height=32,
            width=48,
            num_inference_steps=3,
            guidance_scale=guidance or 0.0,
            output_type="np",
            generator=torch.Generator().manual_seed(req.sampling_params.seed),
        ).images[0]
        assert want.std() > 0.01
        assert psnr(out.output[0] * 255, want * 255) >= 40.0
    assert psnr(outputs[0].output[0] * 255, outputs[1].output[0] * 255) < 30.0


def test_a_bare_request_runs_the_turbo_defaults(ours, reference):
    """No steps, guidance or size: Z-Image-Turbo's model card (9 steps, guidance 0, 1024^2), on the sigmas
    diffusers' pipeline sets for 9 steps."""
    with torch.inference_mode():
        state = ours.prepare([OmniDiffusionRequest("a red cube", SP(seed=0), "bare")], None)
    assert state.latents.shape == (1, 16, 128, 128) and not state.conditioning.do_cfg
    reference(
        prompt="a red cube",
        height=32,
        width=32,
        num_inference_steps=9,
        guidance_scale=0.0,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    )
    torch.testing.assert_close(state.scheduler.sigmas, reference.scheduler.sigmas, rtol=0, atol=0)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"height": 40}, "height"),
        ({"true_cfg_scale": 4.0}, "true_cfg_scale"),
        ({"negative": "blurry"}, "negative_prompt"),
    ],
)
def test_bad_request_fails_alone_naming_the_field(ours, params, field):
    bad, good = request("a cat", 1, "bad", **params), request("a cat", 2, "good")
    out_bad, out_good = ours.forward(DiffusionRequestBatch([bad, good]))
    assert out_good.error is None and out_bad.error is not None
    assert out_bad.error_status_code == 400 and field in out_bad.error


def test_step_mode_cobatched_requests_equal_their_solo_outputs(ours):
    """max_num_seqs 4: different prompts (so different text lengths), step counts, CFG on/off and scales, one
    of another size (its own forward); they join and leave mid-flight."""
    reqs = [
        request(PROMPTS[0], 1, "a", num_inference_steps=4, guidance_scale=4.0),
        request(PROMPTS[1], 2, "b", num_inference_steps=2),
        request(PROMPTS[2], 3, "c", num_inference_steps=3, guidance_scale=2.5, negative="blurry"),
        request(PROMPTS[1], 4, "d", num_inference_steps=2, height=48, width=32),
    ]
    forwards = cobatched_forwards(ours, reqs)
    assert max(forwards) == 3  # a, b and c shared forwards; d (another size) never joined them


def test_lossless_is_bitwise_uncached_and_high_reuses_steps(ours, z_image_dir):
    cached = load(z_image_dir, cache_backend="tea_cache")
    high, reference = check_lossless_and_high(
        ours, cached, lambda **params: request(PROMPTS[0], 5, num_inference_steps=5, **params)
    )
    assert psnr(high.output[0] * 255, reference.output[0] * 255) > 15.0


def test_cache_dit_is_refused_naming_the_alternative(z_image_dir):
    """cache-dit has no adapter for Z-Image's blocks: a request it would cache is a 422, lossless still runs."""
    dit = load(z_image_dir, cache_backend="cache_dit")
    (out,) = dit.forward(DiffusionRequestBatch([request(PROMPTS[0], 5, quality="high")]))
    assert out.error_status_code == 422 and "tea_cache" in out.error
    run(dit, request(PROMPTS[0], 5, quality="lossless"))
