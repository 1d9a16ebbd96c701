"""Shared DiT layers: RoPE and modulation helpers equal diffusers' formulas; regional compile finds the repeated
blocks; the compiled forward leaves the module's class forward in place, and its CUDA-graph runner replays per
input signature and drops its graphs when the worker moves the weights (sleep / wake)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_omni.diffusion.layers import cuda_graph
from vllm_omni.diffusion.layers.compile import accelerate_transformer, call_compiled, compile_repeated_blocks
from vllm_omni.diffusion.layers.modulation import gated_residual, layer_norm_modulate
from vllm_omni.diffusion.layers.rope import multi_axis_rope_cos_sin


def test_rope_matches_diffusers():
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    from vllm_omni.diffusion.layers.qk_norm_rope import qk_norm_rope

    ids = torch.stack([torch.zeros(12), torch.arange(12.0) % 4, torch.arange(12.0) // 4], dim=-1)
    want_cos, want_sin = FluxPosEmbed(theta=10000, axes_dim=[8, 12, 12])(ids)
    cos, sin = multi_axis_rope_cos_sin(ids, (8, 12, 12), 10000.0)
    torch.testing.assert_close((cos, sin), (want_cos[:, ::2], want_sin[:, ::2]), rtol=0, atol=0)
    torch.testing.assert_close((cos, sin), (want_cos[:, 1::2], want_sin[:, 1::2]), rtol=0, atol=0)
    # With unit norm weights on unit-RMS heads, the fused op's rotation is diffusers' apply_rotary_emb.
    x = torch.randn(2, 12, 3, 32)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    ones = torch.ones(32)
    qkv = torch.cat([x, x, x], dim=2).flatten(2)
    q, _, _ = qk_norm_rope(qkv, (ones, ones), (cos, sin), num_heads=3, eps=0.0)
    torch.testing.assert_close(q, apply_rotary_emb(x, (want_cos, want_sin), sequence_dim=1), rtol=1e-5, atol=1e-5)


def test_modulation_helpers():
    x, shift, scale, gate = torch.randn(2, 5, 8), torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8)
    normed = nn.LayerNorm(8, elementwise_affine=False, eps=1e-6)(x)
    torch.testing.assert_close(layer_norm_modulate(x, shift, scale), normed * (1 + scale[:, None]) + shift[:, None])
    torch.testing.assert_close(gated_residual(x, gate, normed), x + gate[:, None] * normed)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.linear(x))


class _Model(nn.Module):
    _repeated_blocks = ("_Block",)

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.Linear(4, 4)

    def forward(self, x, scale: float = 1.0, shift: tuple[torch.Tensor, ...] | None = None):
        for block in self.blocks:
            x = block(x)
        out = self.head(x) * scale
        return out if shift is None else out + shift[0]


def test_compile_repeated_blocks_counts_only_listed_classes():
    model = _Model()
    assert compile_repeated_blocks(model) == 3
    with pytest.raises(ValueError, match="no _repeated_blocks"):
        compile_repeated_blocks(nn.Linear(2, 2))


def test_graph_inputs_include_keyword_tensors_in_a_stable_order():
    """Regression: keyword tensors (e.g. FLUX's guidance / RoPE tables) must be copied into the graph's static
    inputs on every replay, or a replay reads the freed tensors of the call that was captured."""
    x, g, cos, sin = (torch.randn(2) for _ in range(4))
    inputs = cuda_graph.flatten_call((x,), {"rotary_emb": (cos, sin), "guidance": g, "scale": 2.0})
    assert [t.data_ptr() for t in cuda_graph._tensors(inputs)] == [t.data_ptr() for t in (x, g, cos, sin)]
    fresh = [t.clone() for t in cuda_graph._tensors(inputs)]
    args, items = cuda_graph._rebuild(inputs, list(fresh))
    kwargs = dict(items)
    assert args[0] is fresh[0] and kwargs["guidance"] is fresh[1] and kwargs["rotary_emb"] == (fresh[2], fresh[3])
    assert kwargs["scale"] == 2.0


def test_compiled_forward_wraps_the_module_and_counts():
    """The compiled path is a callable beside the module: the instance keeps its class's `forward` and torch's
    methods, the skeleton's call (`call_compiled`) goes through it, module hooks still run where no CUDA graph
    replays, and an eager module is called as is."""
    model, x = _Model().eval(), torch.randn(2, 4)
    assert call_compiled(model, x).equal(model(x))  # eager: no compiled forward
    compiled = accelerate_transformer(model, compile_blocks=False, cuda_graphs=False)
    assert model.compiled_forward is compiled and compiled.module is model and compiled.runner is None
    assert "forward" not in vars(model) and "_apply" not in vars(model)
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    with torch.inference_mode():
        torch.testing.assert_close(call_compiled(model, x, scale=2.0), type(model).forward(model, x, scale=2.0))
    assert calls == [x.shape] and compiled.compiles == 0 and compiled.captures == 0  # nothing compiles on CPU


def test_worker_move_drops_cuda_graphs():
    """Sleep / wake move the weights: the worker drops the graphs captured on their old addresses."""
    from types import SimpleNamespace

    from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker

    pipeline = nn.Module()
    pipeline.transformer = _Model()
    compiled = accelerate_transformer(pipeline.transformer, compile_blocks=False)
    compiled.runner.graphs["captured"] = object()  # a graph captured before the move (none can be on the CPU)
    DiffusionWorker._move_modules(SimpleNamespace(model_runner=SimpleNamespace(pipeline=pipeline)), torch.device("cpu"))
    assert not compiled.runner.graphs


@pytest.mark.cuda
def test_cuda_graph_runner_replays_and_resets_on_move():
    model = _Model().cuda().eval()
    eager = _Model().cuda().eval()
    eager.load_state_dict(model.state_dict())
    compiled = accelerate_transformer(model, compile_blocks=False)
    with torch.inference_mode():
        for shape, scale in (((2, 4), 1.0), ((2, 4), 2.0), ((3, 4), 1.0), ((2, 4), 1.0)):
            x = torch.randn(*shape, device="cuda")
            shift = (torch.randn(4, device="cuda"),)  # a fresh keyword tensor every call
            torch.testing.assert_close(compiled(x, scale=scale, shift=shift), eager(x, scale=scale, shift=shift))
        assert len(compiled.runner.graphs) == 3 and compiled.captures == 3
        model.to("cpu").to("cuda")  # sleep / wake: weights land on new addresses...
        compiled.drop_cuda_graphs()  # ...and the worker drops the graphs (test_worker_move_drops_cuda_graphs)
        assert not compiled.runner.graphs
        x = torch.randn(2, 4, device="cuda")
        torch.testing.assert_close(compiled(x), eager(x))
        compiled.runner.max_graphs = 2
        for rows in (1, 2, 3, 1):
            x = torch.randn(rows, 4, device="cuda")
            torch.testing.assert_close(compiled(x), eager(x))
        # Least recently used signatures were evicted (and recaptured on return), never run uncaptured.
        assert len(compiled.runner.graphs) == 2


def test_device_ints_writes_the_values():
    assert cuda_graph.device_ints([3, 0, 7], torch.device("cpu")).tolist() == [3, 0, 7]


@pytest.mark.cuda
def test_device_ints_can_be_captured():
    """A forward that builds its index tensors with device_ints records as a CUDA graph (no host-to-device copy;
    Z-Image's capture failed on `out[i] = value`) and replays them."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # raises on a host-to-device copy from pageable memory
        out = cuda_graph.device_ints([5, 1, 9], torch.device("cuda")) * 2
    graph.replay()
    assert out.tolist() == [10, 2, 18]
