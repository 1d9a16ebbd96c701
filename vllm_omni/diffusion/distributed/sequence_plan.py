"""A family's sequence-parallel plan (our counterpart of diffusers' `_cp_plan`): where its transformer's image/video
tokens are split over the sequence-parallel ranks and where the whole sequence is gathered back.

A transformer class declares `_sp_plan`: submodule name -> what happens to that submodule's output (`AtOutput`)
or to some of its inputs (`AtInputs`), a `Split` (this rank's contiguous slice, `shard_sequence`) or a `Gather`
(`gather_sequence`). Typically the patch embedding's output and the image RoPE tables are split, text stays
whole, and the output projection's result is gathered:

    _sp_plan = {
        "x_embedder": AtOutput(Split(dim=1)),
        "rotary_emb": AtOutput(Split(dim=0, text_from="txt_ids")),  # [text; image] tables: text stays whole
        "proj_out": AtOutput(Gather(dim=1)),
    }

The family's forward is then single-rank code. A family that cannot run sequence parallel declares
`_sp_plan = None` (a class without the attribute counts as such); building it with `--ulysses-degree`,
`--ring-degree` or `--allgather-degree` above 1 fails (`check_sequence_plan`).

`load_native_transformer` applies the plan once, when it builds a model under sequence parallelism, as public
module hooks (`register_forward_pre_hook(with_kwargs=True)`, `register_forward_hook`) rather than as a call in the
pipeline skeleton: the skeleton sees transformer rows, never the token axis, and a hooked submodule shards
wherever it runs, also where the pipeline calls it outside the forward (FLUX's RoPE tables, computed once per
request). The plan names submodules only, never the model itself: the compiled path replays the model's
`forward` as a CUDA graph without `__call__`, where hooks on the model would not run, while its submodules' do.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vllm_omni.diffusion.distributed.parallel_state import sequence_parallel_size
from vllm_omni.diffusion.distributed.sequence import gather_sequence, shard_sequence


@dataclass(frozen=True)
class Split:
    """This rank's contiguous slice along `dim` of a tensor (of each tensor of a tuple)."""

    dim: int = 1
    ndim: int | None = None
    """Only a tensor with this many dims is split, another passes whole: Wan's timestep embedding has a token
    axis only with per-token timesteps (Wan2.2 TI2V)."""
    text_from: str | None = None
    """The module input whose length (dim 0) is the count of leading entries along `dim` that stay whole: text
    tokens joined before the image tokens (FLUX's [text; image] RoPE tables)."""


@dataclass(frozen=True)
class Gather:
    """The whole sequence along `dim` on every rank (of each tensor of a tuple)."""

    dim: int = 1


Move = Split | Gather | tuple["Move | None", ...]
"""What happens to a value; a tuple holds one entry per item of a tuple value (None: the item passes as it is)."""


@dataclass(frozen=True)
class AtOutput:
    """`move` applied to the submodule's output."""

    move: Move


@dataclass(frozen=True)
class AtInputs:
    """Each named input of the submodule's forward moved before it runs."""

    moves: Mapping[str, Move]


SequencePlan = Mapping[str, AtOutput | AtInputs]
SequenceFn = Callable[[torch.Tensor, int], torch.Tensor]


def check_sequence_plan(cls: type[nn.Module]) -> None:
    """Refuse, before building it, a transformer class without a plan when sequence parallelism is on."""
    if sequence_parallel_size() > 1 and getattr(cls, "_sp_plan", None) is None:
        raise ValueError(
            f"{cls.__name__} does not support sequence parallelism (--ulysses-degree, --ring-degree, "
            "--allgather-degree); use --tensor-parallel-size or --cfg-parallel-size")


def apply_sequence_plan(model: nn.Module, plan: SequencePlan | None = None, *, split: SequenceFn = shard_sequence,
                        gather: SequenceFn = gather_sequence) -> list[RemovableHandle]:
    """Hook `plan` (default: `model`'s class's `_sp_plan`) onto `model`'s submodules; returns the hooks' handles.

    `split` / `gather` (tensor, dim) -> tensor are this rank's slice and the whole sequence; a test passes its
    own to run the plan without ranks. Hooks run in registration order, so a submodule's other output hooks
    (LoRA deltas) are registered to run before these (`prepend`)."""
    plan = type(model)._sp_plan if plan is None else plan
    handles = []
    for name, where in plan.items():
        if not name:
            raise ValueError("a sequence-parallel plan names submodules, not the model itself (its compiled "
                             "forward runs without module hooks)")
        module = model.get_submodule(name)
        signature = inspect.signature(module.forward)
        if isinstance(where, AtInputs):
            needs = set(where.moves) | _text_inputs(tuple(where.moves.values()))
        else:
            needs = _text_inputs(where.move)
        unknown = needs - set(signature.parameters)
        if unknown:
            raise ValueError(f"sequence-parallel plan: {name} takes no input(s) {sorted(unknown)}")
        if isinstance(where, AtInputs):
            handles.append(module.register_forward_pre_hook(
                _input_hook(signature, where.moves, split, gather), with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(
                _output_hook(signature, where.move, split, gather), with_kwargs=True))
    return handles


def _text_inputs(move: Move | None) -> set[str]:
    """The module inputs `move` reads (`Split.text_from`)."""
    if isinstance(move, tuple):
        return set().union(*map(_text_inputs, move))
    return {move.text_from} if isinstance(move, Split) and move.text_from is not None else set()


def _input_hook(signature: inspect.Signature, moves: Mapping[str, Move], split: SequenceFn, gather: SequenceFn
                ) -> Callable[..., tuple[tuple, dict[str, Any]]]:
    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        bound = signature.bind(*args, **kwargs)
        for name, move in moves.items():
            if name in bound.arguments:
                bound.arguments[name] = _apply(move, bound.arguments[name], bound, split, gather)
        return bound.args, bound.kwargs

    return hook


def _output_hook(signature: inspect.Signature, move: Move, split: SequenceFn, gather: SequenceFn) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        return _apply(move, output, signature.bind(*args, **kwargs), split, gather)

    return hook


def _apply(move: Move | None, value: Any, inputs: inspect.BoundArguments, split: SequenceFn, gather: SequenceFn) -> Any:
    if move is None or value is None:
        return value
    if isinstance(move, tuple):
        return type(value)(_apply(m, v, inputs, split, gather) for m, v in zip(move, value, strict=True))
    if isinstance(value, tuple | list):
        return type(value)(_apply(move, v, inputs, split, gather) for v in value)
    if isinstance(move, Gather):
        return gather(value, move.dim)
    if move.ndim is not None and value.dim() != move.ndim:
        return value
    if move.text_from is None:
        return split(value, move.dim)
    text = inputs.arguments[move.text_from].shape[0]
    image = split(value.narrow(move.dim, text, value.shape[move.dim] - text), move.dim)
    return torch.cat([value.narrow(move.dim, 0, text), image], dim=move.dim)
