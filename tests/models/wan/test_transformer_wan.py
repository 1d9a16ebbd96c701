"""Our Wan DiT vs diffusers' WanTransformer3DModel on the same tiny checkpoint.

Why it matters: the pipelines only match diffusers if the DiT does; this pins the weight-name mapping, the
3D RoPE, fp32 modulation and the I2V image-token branch at a tight tolerance.
"""

from __future__ import annotations

import pytest
import torch


def _load_ours(model_dir):
    from vllm_omni.diffusion.model_loader.diffusers_loader import iter_component_weights
    from vllm_omni.diffusion.model_loader.weight_utils import process_weights_after_loading
    from vllm_omni.models.wan.transformer import WanTransformer3DModel, WanTransformerConfig

    model = WanTransformer3DModel(WanTransformerConfig.from_json(model_dir / "transformer" / "config.json"))
    loaded = model.load_weights(iter_component_weights(model_dir, "transformer"))
    assert loaded == {n for n, _ in model.named_parameters()}, "every parameter must come from the checkpoint"
    process_weights_after_loading(model)
    return model.eval()


@pytest.mark.parametrize("fixture", ["wan21_t2v_dir", "wan21_i2v_dir"])
def test_transformer_matches_diffusers(dist_world, request, fixture):
    from diffusers import WanTransformer3DModel as RefModel

    model_dir = request.getfixturevalue(fixture)
    ours = _load_ours(model_dir)
    ref = RefModel.from_pretrained(model_dir / "transformer", dtype=torch.float32).eval()
    cfg = ref.config
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, cfg.in_channels, 3, 8, 12, generator=gen)
    t = torch.tensor([999.0, 250.0])
    text = torch.randn(2, 512 if cfg.image_dim else 20, cfg.text_dim, generator=gen)
    image = torch.randn(2, 17, cfg.image_dim, generator=gen) if cfg.image_dim else None
    with torch.no_grad():
        if image is not None:  # diffusers takes image tokens concatenated before the 512 text tokens
            expected = ref(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
        else:
            expected = ref(x, t, text, return_dict=False)[0]
        got = ours(x, t, text, image)
    assert got.shape == expected.shape == (2, 16, 3, 8, 12)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_compiled_blocks_match_eager(dist_world, wan21_i2v_dir):
    """`enforce_eager=False` compiles every block (whole graph, no breaks): same output as eager (I2V branch too)."""
    from vllm_omni.diffusion.layers.compile import compile_repeated_blocks

    ours = _load_ours(wan21_i2v_dir)
    cfg = ours.config
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, cfg.in_channels, 3, 8, 12, generator=gen)
    t = torch.tensor([999.0, 250.0])
    text, image = torch.randn(2, 512, cfg.text_dim, generator=gen), torch.randn(2, 17, cfg.image_dim, generator=gen)
    with torch.no_grad():
        eager = ours(x, t, text, image)
        assert compile_repeated_blocks(ours) == cfg.num_layers
        torch.testing.assert_close(ours(x, t, text, image), eager, rtol=1e-4, atol=1e-4)
