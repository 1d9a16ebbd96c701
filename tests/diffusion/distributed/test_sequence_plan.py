"""The sequence-parallel plan applier (vllm_omni/diffusion/distributed/sequence_plan.py), without ranks.

What it pins: on a toy transformer, each fake rank of two gets, through the hooks of the class's `_sp_plan`, its
slice of what the plan splits (a patch embedding's output; the image rows of [text; image] RoPE tables, text
whole; a per-token tensor, a pooled one of another rank left whole) and the gather sees this rank's slice and feeds
its result to the submodule; removing the hooks restores the single-rank forward; a LoRA delta hooked after the
plan (as adapters load while serving) still lands on the layer's whole output before the plan splits it. Plans
that name the model itself or an input its submodule lacks fail when applied. Under sequence parallelism,
building a transformer class without a plan (LTX-2, Qwen-Image-2.1, a class that declares none) fails before it
is built, naming the flags; every native family with a plan applies it to its tiny transformer (the gloo tests in
this folder run them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from vllm_omni.diffusion.distributed import sequence_plan
from vllm_omni.diffusion.distributed.sequence_plan import (
    AtInputs,
    AtOutput,
    Gather,
    Split,
    apply_sequence_plan,
    check_sequence_plan,
)


class ToyRope(nn.Module):
    def forward(self, txt_ids: torch.Tensor, img_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.cat([txt_ids, img_ids]).float()
        return ids.cos(), ids.sin()


class ToyCondition(nn.Module):
    def forward(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-token embedding (B, S, 4), pooled (B, 4))."""
        per_token = t[..., None].expand(-1, -1, 4)
        return per_token, per_token.mean(dim=1)


class ToyHead(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class Toy(nn.Module):
    _sp_plan = {
        "embed": AtOutput(Split(dim=1)),
        "rope": AtOutput(Split(dim=0, text_from="txt_ids")),
        "condition": AtOutput((Split(dim=1, ndim=3), Split(dim=1, ndim=3))),
        "head": AtInputs({"x": Gather(dim=1)}),
    }

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.rope, self.condition, self.head = nn.Linear(3, 4), ToyRope(), ToyCondition(), ToyHead(4, 2)

    def forward(self, img: torch.Tensor, txt_ids: torch.Tensor, img_ids: torch.Tensor, t: torch.Tensor):
        x = self.embed(img)
        cos, sin = self.rope(txt_ids, img_ids)
        per_token, pooled = self.condition(t)
        x = x + per_token + pooled[:, None] + cos[-x.shape[1]:, :1]
        self.seen = (x, cos, sin, per_token, pooled)
        return self.head(x)


def _inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return torch.randn(2, 6, 3), torch.arange(5)[:, None] * 1.0, torch.arange(6)[:, None] + 5.0, torch.rand(2, 6)


@pytest.mark.parametrize("rank", [0, 1])
def test_plan_splits_declared_outputs_and_gathers_declared_inputs(rank):
    torch.manual_seed(0)
    model, inputs = Toy(), _inputs()
    want = model(*inputs)
    full_x, full_cos, full_sin, full_per_token, full_pooled = model.seen
    gathered = []

    def gather(x: torch.Tensor, dim: int) -> torch.Tensor:  # the other rank's slice is the whole run's
        gathered.append((x, dim))
        return torch.cat([x if r == rank else part for r, part in enumerate(full_x.chunk(2, dim))], dim)

    handles = apply_sequence_plan(model, split=lambda x, dim: x.chunk(2, dim)[rank], gather=gather)
    got = model(*inputs)
    x, cos, sin, per_token, pooled = model.seen
    text = inputs[1].shape[0]
    for table, full in ((cos, full_cos), (sin, full_sin)):
        assert torch.equal(table, torch.cat([full[:text], full[text:].chunk(2)[rank]]))
    assert torch.equal(per_token, full_per_token.chunk(2, 1)[rank])
    assert torch.equal(pooled, full_pooled)  # not 3-D: whole
    assert torch.equal(x, full_x.chunk(2, 1)[rank])
    assert len(gathered) == 1 and gathered[0][0] is x and gathered[0][1] == 1
    assert torch.equal(got, want)
    for handle in handles:
        handle.remove()
    assert torch.equal(model(*inputs), want) and torch.equal(model.seen[0], full_x)


def test_a_lora_delta_lands_on_the_layer_output_before_the_plan_splits_it():
    from types import SimpleNamespace

    from vllm_omni.diffusion.lora import LoRAManager, _Delta, _Rows, _Segment

    torch.manual_seed(0)
    model, inputs = Toy(), _inputs()
    rows = _Rows([_Segment("a", 0, 2, 0.5)])
    delta = _Delta(torch.randn(2, 3), torch.randn(4, 2))
    want = model.embed(inputs[0]) + 0.5 * inputs[0] @ delta.a.T @ delta.b.T
    apply_sequence_plan(model, split=lambda x, dim: x.chunk(2, dim)[1], gather=lambda x, dim: x)
    LoRAManager._hook(SimpleNamespace(_rows=rows), model.embed).deltas["a"] = delta  # after the plan, as at serving
    torch.testing.assert_close(model.embed(inputs[0]), want.chunk(2, 1)[1])


@pytest.mark.parametrize("plan, error", [
    ({"": AtOutput(Gather())}, "names submodules, not the model itself"),
    ({"head": AtInputs({"hidden": Gather()})}, r"head takes no input\(s\) \['hidden'\]"),
    ({"rope": AtOutput(Split(0, text_from="text_ids"))}, r"rope takes no input\(s\) \['text_ids'\]"),
])
def test_plan_naming_what_is_not_there_fails_when_applied(plan, error):
    with pytest.raises(ValueError, match=error):
        apply_sequence_plan(Toy(), plan)


def test_a_class_without_plan_is_refused_only_under_sequence_parallel(monkeypatch):
    from vllm_omni.diffusion.model_loader.components import load_native_transformer
    from vllm_omni.models.flux.transformer import FluxTransformer2DModel
    from vllm_omni.models.ltx2.transformer import LTX2VideoTransformer3DModel
    from vllm_omni.models.qwen_image_21.transformer import QwenImage21Transformer2DModel

    class NoPlan(nn.Module):
        pass

    for cls in (LTX2VideoTransformer3DModel, QwenImage21Transformer2DModel, NoPlan, FluxTransformer2DModel):
        check_sequence_plan(cls)
    monkeypatch.setattr(sequence_plan, "sequence_parallel_size", lambda: 2)
    check_sequence_plan(FluxTransformer2DModel)
    for cls in (LTX2VideoTransformer3DModel, QwenImage21Transformer2DModel, NoPlan):
        with pytest.raises(ValueError, match=rf"^{cls.__name__} does not support sequence parallelism "
                                             r"\(--ulysses-degree, --ring-degree, --allgather-degree\)"):
            check_sequence_plan(cls)
    with pytest.raises(ValueError, match="does not support sequence parallelism"):  # before it reads anything
        load_native_transformer(QwenImage21Transformer2DModel, Path("/nonexistent"), "transformer", None,
                                torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("name, module, cls", [
    ("qwen-image", "qwen_image", "QwenImageTransformer2DModel"),
    ("flux", "flux", "FluxTransformer2DModel"),
    ("flux2-klein-base", "flux2", "Flux2Transformer2DModel"),
    ("z-image-turbo", "z_image", "ZImageTransformer2DModel"),
    ("hunyuan-image-2.1", "hunyuan_image_21", "HunyuanImageTransformer2DModel"),
    ("wan2.1-t2v", "wan", "WanTransformer3DModel"),
])
def test_every_family_plan_applies_to_its_transformer(dist_world, name, module, cls):
    import importlib

    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.diffusion.model_loader.diffusers_loader import read_component_config

    model_cls = getattr(importlib.import_module(f"vllm_omni.models.{module}.transformer"), cls)
    model = model_cls.from_config(read_component_config(build_tiny(name), "transformer"))
    handles = apply_sequence_plan(model, split=lambda x, dim: x, gather=lambda x, dim: x)
    assert len(handles) == len(model_cls._sp_plan)
