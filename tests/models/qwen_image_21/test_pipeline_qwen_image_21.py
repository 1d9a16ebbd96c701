"""Native Qwen-Image-2.1 vs diffusers on the same tiny checkpoint (fp32, CPU, in this process).

Pins: the text K/V our transformer computes once (`prefix_kv`) are the ones diffusers' "extract" step stores,
and the image rows of every step equal diffusers' cached-step rows, for rows of different prompt lengths in
one forward; the pipeline gives diffusers' images (KV cache on) for the same seeds with and without true CFG;
step mode co-batches requests of different prompts (so different prefix lengths), step counts and CFG, and
each ends with its solo output (the prefix K/V are the state's, never shared); `quality="lossless"` is bitwise
the uncached output and `high` reuses the steps of its schedule.
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
    from vllm_omni.models.qwen_image_21.pipeline import QwenImage21Pipeline

    return QwenImage21Pipeline.from_pretrained(
        OmniDiffusionConfig(model=str(model_dir), **config), model_dir, CPU, torch.float32
    )


@pytest.fixture(scope="module")
def ours(qwen_image_21_dir):
    return load(qwen_image_21_dir)


@pytest.fixture(scope="module")
def reference(qwen_image_21_dir):
    """diffusers' pipeline; its Qwen3VLProcessor is built without the video half (that needs torchvision)."""
    from diffusers import QwenImage21Pipeline
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor

    mp = pytest.MonkeyPatch()
    mp.setattr(Qwen3VLProcessor, "check_argument_for_proper_class", lambda self, name, arg: None)
    tokenizer = AutoTokenizer.from_pretrained(qwen_image_21_dir / "processor")
    processor = Qwen3VLProcessor(
        image_processor=AutoImageProcessor.from_pretrained(qwen_image_21_dir / "processor"),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
    )
    mp.undo()
    pipe = QwenImage21Pipeline.from_pretrained(qwen_image_21_dir, processor=processor, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def request(
    prompt: str, seed: int, rid: str | None = None, negative: str | None = None, **params
) -> OmniDiffusionRequest:
    params = {"height": 64, "width": 96, "num_inference_steps": 3, "output_type": "np", **params}
    return OmniDiffusionRequest(
        {"prompt": prompt, "negative_prompt": negative}, SP(seed=seed, **params), rid or f"r{seed}"
    )


def test_prefix_kv_and_image_rows_match_diffusers_extract_and_cached_steps(ours, reference):
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    torch.manual_seed(0)
    ref = reference.transformer
    dim, channels, layers = ref.config.context_in_dim, ref.config.in_channels, ref.config.num_layers
    h, w = 4, 6
    texts = [torch.randn(7, dim), torch.randn(12, dim)]
    latents = torch.randn(2, h * w, channels)
    t0, t1 = torch.tensor([0.9, 0.7]), torch.tensor([0.5, 0.2])
    kv = torch.zeros(2, layers, 2, 12, ours.transformer.num_heads, ours.transformer.head_dim)
    with torch.inference_mode():
        for b, text in enumerate(texts):
            n = text.shape[0]
            cache = QwenImage21KVCache(layers)
            args = dict(
                encoder_hidden_states=text[None],
                img_shapes=[[(1, h, w)]],
                kv_cache=cache,
                return_dict=False,
                img_mask=torch.cat(
                    [torch.zeros(1, n, dtype=torch.bool), torch.ones(1, h * w // 4, dtype=torch.bool)], 1
                ),
            )
            extract = ref(hidden_states=latents[b : b + 1], timestep=t0[b : b + 1], kv_cache_mode="extract", **args)[0]
            cached = ref(hidden_states=latents[b : b + 1], timestep=t1[b : b + 1], kv_cache_mode="cached", **args)[0]
            kv[b, :, :, :n] = ours.transformer.prefix_kv(text[None])[0][0]
            want_kv = torch.stack([torch.stack(cache.get_layer(i).get()) for i in range(layers)])
            torch.testing.assert_close(kv[b, :, :, :n], want_kv[:, :, 0], rtol=1e-5, atol=1e-5)
            got0 = ours.transformer(latents[b : b + 1], t0[b : b + 1], kv[b : b + 1, :, :, :n], (n,), (n,), (h, w))
            torch.testing.assert_close(got0, extract[:, -h * w :], rtol=1e-5, atol=1e-5)
            if b == 1:
                got = ours.transformer(latents, t1, kv, (7, 12), (7, 12), (h, w))
                torch.testing.assert_close(got[1:], cached, rtol=1e-5, atol=1e-5)
            else:
                want_first = cached
        torch.testing.assert_close(got[:1], want_first, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [None, 3.0])
def test_batched_requests_match_diffusers(ours, reference, cfg):
    """Without CFG (diffusers' default) and with true CFG (two prompts, two negative prompts)."""
    negatives = ["blurry", "low quality, watermark"] if cfg else [None, None]
    extra = {} if cfg is None else {"true_cfg_scale": cfg}
    reqs = [
        request(p, 10 + i, negative=n, **extra) for i, (p, n) in enumerate(zip(PROMPTS[:2], negatives, strict=True))
    ]
    outputs = ours.forward(DiffusionRequestBatch(reqs))
    for req, out in zip(reqs, outputs, strict=True):
        assert out.error is None, out.error
        want = reference(
            prompt=req.prompt_text,
            negative_prompt=req.negative_prompt,
            height=64,
            width=96,
            num_inference_steps=3,
            true_cfg_scale=cfg or 1.0,
            output_type="np",
            generator=torch.Generator().manual_seed(req.sampling_params.seed),
        ).images[0]
        assert want.std() > 0.01
        assert psnr(out.output[0] * 255, want * 255) >= 40.0
    assert psnr(outputs[0].output[0] * 255, outputs[1].output[0] * 255) < 30.0


def condition_image(seed: int):
    """A 300 x 200 RGB picture: resized to 1248 x 832 (about 1024^2) as the condition."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (200, 300, 3), dtype=np.uint8))


def test_edit_request_matches_diffusers(ours, reference):
    """A condition image: the text encoder sees it in its vision slots, its VAE latents fill those slots of the
    prefix (a bidirectional block in the causal prefix); with true CFG the negative sees it too."""
    image = condition_image(0)
    req = OmniDiffusionRequest(
        {"prompt": "make it blue", "negative_prompt": "blurry", "multi_modal_data": {"image": image}},
        SP(seed=4, height=64, width=96, num_inference_steps=2, true_cfg_scale=3.0, output_type="np"),
        "edit",
    )
    (out,) = ours.forward(DiffusionRequestBatch([req]))
    assert out.error is None, out.error
    want = reference(
        prompt="make it blue",
        negative_prompt="blurry",
        image=image,
        height=64,
        width=96,
        num_inference_steps=2,
        true_cfg_scale=3.0,
        output_type="np",
        generator=torch.Generator().manual_seed(4),
    ).images[0]
    assert want.std() > 0.01
    assert psnr(out.output[0] * 255, want * 255) >= 40.0
    plain = run(ours, request("make it blue", 4, negative="blurry", num_inference_steps=2, true_cfg_scale=3.0))
    assert psnr(out.output[0] * 255, plain.output[0] * 255) < 50.0  # the image conditions the output


def test_a_bare_request_runs_diffusers_defaults(ours, reference):
    """No steps or size: diffusers' 40 steps at 1024^2 on the sigmas its pipeline sets; the system message is
    dropped as diffusers counts it."""
    assert ours.drop_tokens == reference._drop_idx
    with torch.inference_mode():
        state = ours.prepare([OmniDiffusionRequest("a red cube", SP(seed=0), "bare")], None)
    assert state.latents.shape == (1, 64 * 64, 16) and not state.conditioning.do_cfg
    reference(
        prompt="a red cube",
        height=1024,
        width=1024,
        num_inference_steps=40,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        callback_on_step_end=_stop,
    )
    torch.testing.assert_close(state.scheduler.sigmas, reference.scheduler.sigmas, rtol=0, atol=0)


def _stop(pipe, i, t, kwargs):
    pipe._interrupt = True
    return kwargs


@pytest.mark.parametrize(
    "params, field",
    [
        ({"height": 40}, "height"),
        ({"guidance_scale": 4.0}, "guidance_scale"),
        ({"negative": "blurry"}, "negative_prompt"),
        ({"true_cfg_scale": 4.0}, "true_cfg_scale"),
    ],
)
def test_bad_request_fails_alone_naming_the_field(ours, params, field):
    bad, good = request("a cat", 1, "bad", **params), request("a cat", 2, "good")
    out_bad, out_good = ours.forward(DiffusionRequestBatch([bad, good]))
    assert out_good.error is None and out_bad.error is not None
    assert out_bad.error_status_code == 400 and field in out_bad.error


def test_step_mode_cobatched_requests_equal_their_solo_outputs(ours):
    """max_num_seqs 4: different prompts (so different prefix K/V lengths), step counts, CFG on/off and scales,
    one of another size (its own forward); they join and leave mid-flight, each with its own prefix K/V."""
    reqs = [
        request(PROMPTS[0], 1, "a", num_inference_steps=4, true_cfg_scale=4.0, negative="blurry"),
        request(PROMPTS[1], 2, "b", num_inference_steps=2),
        request(PROMPTS[2], 3, "c", num_inference_steps=3, true_cfg_scale=2.5, negative="dark, noisy"),
        request(PROMPTS[1], 4, "d", num_inference_steps=2, height=96, width=64),
    ]
    forwards = cobatched_forwards(ours, reqs)
    assert max(forwards) == 3  # a, b and c shared forwards; d (another size) never joined them


def test_step_mode_at_max_num_seqs_8_keeps_each_requests_prefix(ours):
    """Eight requests, eight prompts (one with a condition image), one grid: every forward after the first round
    holds several states' prefixes of different lengths, and each request still ends with its own solo output."""
    words = ["a", "cat", "on", "a", "red", "chair", "under", "the", "bright", "moon", "by", "the", "quiet", "sea"]
    reqs = [request(" ".join(words[: 2 + i]), 20 + i, f"p{i}", num_inference_steps=2) for i in range(7)]
    reqs.append(
        OmniDiffusionRequest(
            {"prompt": "make it blue", "multi_modal_data": {"image": condition_image(1)}},
            SP(seed=27, height=64, width=96, num_inference_steps=2, output_type="np"),
            "p7",
        )
    )
    forwards = cobatched_forwards(ours, reqs, max_num_seqs=8)
    assert max(forwards) == 8


def test_lossless_is_bitwise_uncached_and_high_reuses_steps(ours, qwen_image_21_dir):
    cached = load(qwen_image_21_dir, cache_backend="tea_cache")
    high, plain = check_lossless_and_high(
        ours, cached, lambda **params: request(PROMPTS[0], 5, num_inference_steps=5, **params)
    )
    assert psnr(high.output[0] * 255, plain.output[0] * 255) > 15.0


@pytest.mark.cuda
def test_accelerated_pipeline_matches_eager_on_cuda(qwen_image_21_dir):
    """enforce_eager=False on CUDA (compiled blocks, CUDA graphs, the VAE decoder compiled as the model runner sets
    it), true CFG against a shorter negative prompt (rows of two prefix lengths, each attending over its view of
    the key buffer): the eager pipeline's image."""
    from vllm_omni.diffusion.layers.compile import accelerate_vae_if_requested
    from vllm_omni.models.qwen_image_21.pipeline import QwenImage21Pipeline

    device = torch.device("cuda", torch.cuda.current_device())
    pipes = []
    for eager in (True, False):
        config = OmniDiffusionConfig(model=str(qwen_image_21_dir), enforce_eager=eager)
        pipe = QwenImage21Pipeline.from_pretrained(config, qwen_image_21_dir, device, torch.bfloat16)
        assert accelerate_vae_if_requested(pipe, config) is not eager
        pipes.append(pipe)
    cfg = request(PROMPTS[1], 7, negative="blurry", true_cfg_scale=4.0, output_type="pil")
    eager, fast = (run(pipe, cfg) for pipe in pipes)
    assert psnr(fast.output[0], eager.output[0]) >= 40
    assert 1 <= len(pipes[1].transformer.compiled_forward.runner.graphs) <= 2
