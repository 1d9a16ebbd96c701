"""Wan tests: an in-process gloo world of size 1 (vLLM's parallel layers need its groups) and tiny checkpoints."""

from __future__ import annotations

import sys
import types

import pytest
import torch


def _install_attention_shim() -> None:
    """TEMPORARY: until vllm_omni/diffusion/attention/layer.py lands, an SDPA layer with the agreed signature."""
    try:
        import vllm_omni.diffusion.attention.layer  # noqa: F401
        return
    except ImportError:
        pass

    class Attention(torch.nn.Module):
        def __init__(self, num_heads, head_dim, *, num_kv_heads=None, softmax_scale=None, causal=False, prefix=""):
            super().__init__()
            self.scale, self.causal = softmax_scale, causal

        def forward(self, query, key, value, attn_mask=None):
            mask = None if attn_mask is None else attn_mask[:, None, None, :]
            out = torch.nn.functional.scaled_dot_product_attention(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask,
                is_causal=self.causal, scale=self.scale)
            return out.transpose(1, 2)

    pkg = types.ModuleType("vllm_omni.diffusion.attention")
    pkg.__path__ = []
    layer = types.ModuleType("vllm_omni.diffusion.attention.layer")
    layer.Attention = Attention
    sys.modules["vllm_omni.diffusion.attention"] = pkg
    sys.modules["vllm_omni.diffusion.attention.layer"] = layer


_install_attention_shim()


@pytest.fixture(scope="session")
def dist_world():
    """A gloo world of size 1 with vLLM's TP groups, current for the whole session."""
    from vllm.config import set_current_vllm_config

    from vllm_omni.diffusion.data import DiffusionParallelConfig
    from vllm_omni.diffusion.distributed.parallel_state import (
        destroy_diffusion_distributed,
        init_diffusion_distributed,
    )

    config = init_diffusion_distributed(rank=0, world_size=1, parallel_config=DiffusionParallelConfig(),
                                        device=torch.device("cpu"))
    with set_current_vllm_config(config):
        yield config
    destroy_diffusion_distributed()


@pytest.fixture(scope="session")
def wan21_t2v_dir():
    from vllm_omni.testing.tiny_models import build_tiny

    return build_tiny("wan2.1-t2v")


@pytest.fixture(scope="session")
def wan21_i2v_dir():
    from vllm_omni.testing.tiny_models import build_tiny

    return build_tiny("wan2.1-i2v")


@pytest.fixture(scope="session")
def wan22_a14b_dir():
    from vllm_omni.testing.tiny_models import build_tiny

    return build_tiny("wan2.2-t2v-a14b")
