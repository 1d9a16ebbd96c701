"""Native HunyuanImage-2.1 vs diffusers on the same tiny checkpoints (fp32, CPU, in this process).

Pins: our DiT computes diffusers' function from diffusers' weights for rows of different prompt and glyph lengths
in one forward (the real tokens only, not diffusers' padded 1000 + 128), for the undistilled and the distilled
(guidance-embedded, MeanFlow) transformer; the pipeline gives diffusers' images for the same seeds: CFG then
adaptive projected guidance with its momentum, the OCR guider and ByT5 glyph tokens for a prompt with quoted
text, and the distilled model's embedded guidance; a bare request runs each checkpoint's defaults (50 steps /
the Distilled model card's 8, 2048^2 on the real VAE); step mode co-batches requests of different prompts,
sizes, step counts and guiders and each ends with its solo output; `quality="lossless"` is bitwise the uncached
output and `high` reuses the steps of its schedule.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.image_checks import check_lossless_and_high, cobatched_forwards, psnr
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

pytestmark = pytest.mark.usefixtures("dist_world")
CPU = torch.device("cpu")
PROMPTS = [
    "a photo of a cat sitting on a red chair",
    'a shop sign that says "OPEN 24 HOURS" above the door',
    "mountains",
]


def load(model_dir, **config):
    from vllm_omni.models.hunyuan_image_21.pipeline import HunyuanImagePipeline

    return HunyuanImagePipeline.from_pretrained(
        OmniDiffusionConfig(model=str(model_dir), **config), model_dir, CPU, torch.float32
    )


def diffusers_pipe(model_dir):
    """diffusers' pipeline padding prompts to 64 + 32 tokens instead of 1000 + 128: the padding is masked out of
    every real token's attention, so the images are the same for these short prompts and quoted texts, at a
    tenth of the CPU."""
    from diffusers import HunyuanImagePipeline

    pipe = HunyuanImagePipeline.from_pretrained(model_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length = 64, 32
    return pipe


@pytest.fixture(scope="module")
def ours(hunyuan_image_21_dir):
    return load(hunyuan_image_21_dir)


@pytest.fixture(scope="module")
def reference(hunyuan_image_21_dir):
    return diffusers_pipe(hunyuan_image_21_dir)


@pytest.fixture(scope="module")
def ours_distilled(hunyuan_image_21_distilled_dir):
    return load(hunyuan_image_21_distilled_dir)


@pytest.fixture(scope="module")
def reference_distilled(hunyuan_image_21_distilled_dir):
    return diffusers_pipe(hunyuan_image_21_distilled_dir)


def request(prompt: str, seed: int, rid: str | None = None, negative: str | None = None,
            **params) -> OmniDiffusionRequest:
    params = {"height": 32, "width": 48, "num_inference_steps": 3, "output_type": "np", **params}
    return OmniDiffusionRequest({"prompt": prompt, "negative_prompt": negative}, SP(seed=seed, **params),
                                rid or f"r{seed}")


@pytest.mark.parametrize("distilled", [False, True])
def test_transformer_matches_diffusers_on_rows_of_different_text_lengths(
        ours, reference, ours_distilled, reference_distilled, distilled):
    ours, reference = (ours_distilled, reference_distilled) if distilled else (ours, reference)
    cfg = reference.transformer.config
    torch.manual_seed(0)
    latents = torch.randn(3, cfg.in_channels, 4, 6)
    t = torch.tensor([900.0, 500.0, 100.0])
    lengths, glyph_lengths = (10, 4, 7), (3, 0, 6)
    embeds, glyph = torch.randn(3, 10, cfg.text_embed_dim), torch.randn(3, 6, cfg.text_embed_2_dim)
    mask = torch.arange(10) < torch.tensor(lengths)[:, None]
    glyph_mask = torch.arange(6) < torch.tensor(glyph_lengths)[:, None]
    extra = {"timestep_r": torch.tensor([500.0, 100.0, 0.0]), "guidance": torch.full((3,), 3250.0)} \
        if distilled else {}
    with torch.inference_mode():
        want = reference.transformer(latents, t, embeds, mask.long(), encoder_hidden_states_2=glyph,
                                     encoder_attention_mask_2=glyph_mask.long(), return_dict=False, **extra)[0]
        got = ours.transformer(latents, t, embeds * mask[..., None], lengths, glyph * glyph_mask[..., None],
                               glyph_lengths, **extra)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def diffusers_images(reference, reqs, **extra):
    """diffusers' images for `reqs` (same size and steps) in one call, each row drawn from its request's seed."""
    sp = reqs[0].sampling_params
    return reference(prompt=[r.prompt_text for r in reqs], negative_prompt=[r.negative_prompt or "" for r in reqs],
                     height=sp.height, width=sp.width, num_inference_steps=sp.num_inference_steps, output_type="np",
                     generator=[torch.Generator().manual_seed(r.sampling_params.seed) for r in reqs], **extra).images


def test_batched_requests_match_diffusers(ours, reference):
    """Two plain prompts (default and given negative) and one quoting text (OCR guider, glyph tokens: its own
    group): CFG at steps 0-1, adaptive projected guidance with the momentum at step 2 (the tiny guiders start it
    after step 1)."""
    reqs = [request(PROMPTS[0], 10), request(PROMPTS[2], 11, negative="blurry"), request(PROMPTS[1], 12)]
    outputs = ours.forward(DiffusionRequestBatch(reqs))
    # diffusers picks one guider per call (the OCR one if any prompt quotes text): the plain prompts together.
    wants = [*diffusers_images(reference, reqs[:2]), *diffusers_images(reference, reqs[2:])]
    for out, want in zip(outputs, wants, strict=True):
        assert out.error is None, out.error
        assert want.std() > 0.01
        assert psnr(out.output[0] * 255, want * 255) >= 40.0
    assert psnr(outputs[0].output[0] * 255, outputs[1].output[0] * 255) < 30.0


def test_distilled_matches_diffusers_with_embedded_guidance(ours_distilled, reference_distilled):
    """Default embedded guidance over 2 steps (MeanFlow's next timestep, then 0), `guidance_scale` 5 over 1."""
    for req, scale in ((request(PROMPTS[1], 3, num_inference_steps=2), None),
                       (request(PROMPTS[0], 4, num_inference_steps=1, guidance_scale=5.0), 5.0)):
        (out,) = ours_distilled.forward(DiffusionRequestBatch([req]))
        assert out.error is None, out.error
        (want,) = diffusers_images(reference_distilled, [req], distilled_guidance_scale=scale or 3.25)
        assert want.std() > 0.01
        assert psnr(out.output[0] * 255, want * 255) >= 40.0


@pytest.mark.parametrize("distilled, steps", [(False, 50), (True, 8)])
def test_a_bare_request_runs_the_checkpoint_defaults(ours, reference, ours_distilled, reference_distilled,
                                                     distilled, steps):
    """No steps, guidance or size: 64 latents a side (2048^2 on the real 32x VAE), 50 steps with CFG for
    HunyuanImage-2.1, 8 without for the Distilled model, on the sigmas diffusers' pipeline sets."""
    ours, reference = (ours_distilled, reference_distilled) if distilled else (ours, reference)
    with torch.inference_mode():
        state = ours.prepare([OmniDiffusionRequest("a red cube", SP(seed=0), "bare")], None)
    assert state.latents.shape == (1, 16, 64, 64) and state.conditioning.do_cfg is not distilled
    def stop(pipe, step, t, tensors):  # the sigmas are set before the loop: one step shows them
        pipe._interrupt = True
        return tensors

    reference(prompt="a red cube", height=16, width=16, num_inference_steps=steps, output_type="latent",
              generator=torch.Generator().manual_seed(0), callback_on_step_end=stop)
    torch.testing.assert_close(state.scheduler.sigmas, reference.scheduler.sigmas, rtol=0, atol=0)


@pytest.mark.parametrize(
    "distilled, params, field",
    [
        (False, {"height": 36}, "height"),
        (False, {"true_cfg_scale": 4.0}, "true_cfg_scale"),
        (False, {"guidance_scale": 1.0, "negative": "blurry"}, "negative_prompt"),
        (True, {"negative": "blurry"}, "negative_prompt"),
    ],
)
def test_bad_request_fails_alone_naming_the_field(ours, ours_distilled, distilled, params, field):
    pipe = ours_distilled if distilled else ours
    bad, good = request("a cat", 1, "bad", **params), request("a cat", 2, "good", num_inference_steps=1)
    out_bad, out_good = pipe.forward(DiffusionRequestBatch([bad, good]))
    assert out_good.error is None and out_bad.error is not None
    assert out_bad.error_status_code == 400 and field in out_bad.error


def test_step_mode_cobatched_requests_equal_their_solo_outputs(ours):
    """max_num_seqs 4: different prompts (text lengths), guiders (one quotes text), scales, step counts, one of
    another size (its own forward); they join and leave mid-flight."""
    reqs = [
        request(PROMPTS[0], 1, "a", num_inference_steps=3),
        request(PROMPTS[1], 2, "b", num_inference_steps=2, guidance_scale=5.0),
        request(PROMPTS[2], 3, "c", num_inference_steps=2, negative="blurry"),
        request(PROMPTS[2], 4, "d", num_inference_steps=1, height=48, width=32),
    ]
    forwards = cobatched_forwards(ours, reqs)
    assert max(forwards) == 3  # a, b and c shared forwards; d (another size) never joined them


def test_lossless_is_bitwise_uncached_and_high_reuses_steps(ours_distilled, hunyuan_image_21_distilled_dir):
    """On the distilled checkpoint (one row per step, no CFG: the cache contract is the transformer's)."""
    cached = load(hunyuan_image_21_distilled_dir, cache_backend="tea_cache")
    high, reference = check_lossless_and_high(
        ours_distilled, cached, lambda **params: request(PROMPTS[0], 5, num_inference_steps=5, **params)
    )
    assert psnr(high.output[0] * 255, reference.output[0] * 255) > 15.0
