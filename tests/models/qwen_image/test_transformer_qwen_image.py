"""Pins that our MMDiT computes what diffusers' QwenImageTransformer2DModel computes on the same weights."""

from __future__ import annotations

import pytest
import torch

from vllm_omni.diffusion.model_loader.diffusers_loader import iter_component_weights, read_component_config
from vllm_omni.diffusion.model_loader.weight_utils import process_weights_after_loading
from vllm_omni.models.qwen_image.transformer import (
    QwenImageTransformer2DModel,
    QwenImageTransformerConfig,
)


@pytest.fixture(scope="module")
def models(dist_world, qwen_image_dir):
    from diffusers import QwenImageTransformer2DModel as RefModel

    ref = RefModel.from_pretrained(qwen_image_dir, subfolder="transformer", dtype=torch.float32).eval()
    config = QwenImageTransformerConfig.from_dict(read_component_config(qwen_image_dir, "transformer"))
    ours = QwenImageTransformer2DModel(config=config)
    loaded = ours.load_weights(iter_component_weights(qwen_image_dir, "transformer", torch.float32))
    assert loaded == {name for name, _ in ours.named_parameters()}
    process_weights_after_loading(ours)
    return ref, ours


@pytest.mark.parametrize("shapes", [[(1, 4, 4)], [(1, 4, 6), (1, 6, 4)]], ids=["t2i", "edit-two-images"])
def test_matches_diffusers(models, shapes):
    ref, ours = models
    g = torch.Generator().manual_seed(0)
    batch, txt_len = 3, 7
    img_len = sum(f * h * w for f, h, w in shapes)
    x = torch.randn(batch, img_len, 64, generator=g)
    txt = torch.randn(batch, txt_len, 64, generator=g)
    mask = torch.ones(batch, txt_len, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2, 3:] = False
    t = torch.tensor([0.9, 0.5, 0.1])
    with torch.no_grad():
        expected = ref(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask, timestep=t,
                       img_shapes=[shapes] * batch, return_dict=False)[0]
        got = ours(x, txt, mask, t, shapes)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    # No mask == all-true mask.
    with torch.no_grad():
        torch.testing.assert_close(ours(x[:1], txt[:1], None, t[:1], shapes), got[:1], atol=1e-5, rtol=1e-4)


def test_mask_is_the_key_mask(models):
    """A mask runs as the attention's key mask, read on the device only (what a CUDA graph needs): a mask with
    holes (not trailing padding) still gives diffusers' result, and padding text to a longer length under the
    mask (the compiled path's length buckets) leaves every prediction as it was."""
    ref, ours = models
    assert ours.masks_on_device
    g = torch.Generator().manual_seed(2)
    x, txt, t = torch.randn(2, 16, 64, generator=g), torch.randn(2, 5, 64, generator=g), torch.tensor([0.5, 0.3])
    mask = torch.tensor([[True, False, True, True, True], [True, True, True, False, False]])
    with torch.no_grad():
        expected = ref(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask, timestep=t,
                       img_shapes=[[(1, 4, 4)]] * 2, return_dict=False)[0]
        torch.testing.assert_close(ours(x, txt, mask, t, [(1, 4, 4)]), expected, atol=1e-5, rtol=1e-4)
        lengths = ours(x, txt, None, t, [(1, 4, 4)], txt_lengths=(5, 3))
        padded = torch.cat([txt, torch.randn(2, 11, 64, generator=g)], dim=1)
        bucket_mask = torch.arange(16) < torch.tensor([5, 3])[:, None]
        torch.testing.assert_close(ours(x, padded, bucket_mask, t, [(1, 4, 4)]), lengths, atol=1e-5, rtol=1e-4)


def test_precomputed_step_modulation_equals_inline(models):
    """A denoise loop's adaLN table, computed for all steps at once, gives each step's forward unchanged."""
    _, ours = models
    g = torch.Generator().manual_seed(1)
    x, txt = torch.randn(2, 16, 64, generator=g), torch.randn(2, 5, 64, generator=g)
    steps = torch.tensor([0.9, 0.4, 0.05])
    with torch.no_grad():
        table = ours.step_modulation(steps, torch.float32)
        assert table.shape[:3] == (len(ours.transformer_blocks), 2, 3)
        for i, t in enumerate(steps):
            want = ours(x, txt, None, t.expand(2), [(1, 4, 4)])
            got = ours(x, txt, None, t.expand(2), [(1, 4, 4)], table[:, :, i : i + 1])
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_unsupported_variant_is_refused():
    with pytest.raises(NotImplementedError, match="zero_cond_t"):
        QwenImageTransformerConfig.from_dict({"zero_cond_t": True})
    with pytest.raises(ValueError, match="unsupported .* config keys: \\['bogus'\\]"):
        QwenImageTransformerConfig.from_dict({"bogus": 1})


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["TORCH_SDPA", "CUDNN_ATTN", "FLASH_ATTN"])
def test_cuda_bf16_matches_diffusers(dist_world, qwen_image_dir, backend):
    """bf16 on the GPU, each attention backend that is installed: close to diffusers' bf16 forward. The eager
    forward (its text mask is read on the host): the compiled path is checked on the pipelines."""
    from diffusers import QwenImageTransformer2DModel as RefModel

    from vllm_omni.diffusion.attention.selector import load_backend
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.models.qwen_image.loading import load_qwen_image_transformer

    if load_backend(backend).unavailable_reason():
        pytest.skip(f"{backend} not available here")
    device = torch.device("cuda")
    ref = RefModel.from_pretrained(qwen_image_dir, subfolder="transformer", dtype=torch.bfloat16).to(device).eval()
    ours = load_qwen_image_transformer(OmniDiffusionConfig(model=str(qwen_image_dir),
                                                           diffusion_attention_backend=backend,
                                                           enforce_eager=True),
                                       qwen_image_dir, device, torch.bfloat16)
    assert all(b.attn.attn.attn_backend.get_name() == backend for b in ours.transformer_blocks)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 64, generator=g).to(device, torch.bfloat16)
    txt = torch.randn(2, 9, 64, generator=g).to(device, torch.bfloat16)
    mask = torch.ones(2, 9, dtype=torch.bool, device=device)
    mask[1, 4:] = False
    t = torch.tensor([0.7, 0.2], device=device)
    with torch.no_grad():
        expected = ref(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask, timestep=t,
                       img_shapes=[[(1, 4, 4)]] * 2, return_dict=False)[0]
        got = ours(x, txt, mask, t, [(1, 4, 4)])
    torch.testing.assert_close(got.float(), expected.float(), atol=5e-2, rtol=5e-2)
