"""Replay a transformer forward as a CUDA graph per static input signature.

Below ~768² a DiT forward is host-bound: launching its thousands of kernels takes longer than running them.
Capturing the forward once per (shapes, dtypes, non-tensor args) and replaying it removes that launch cost
and keeps the denoise loop free of allocations. Outputs are copied out of the graph's static buffers so a
caller may hold them across replays.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch


def device_ints(values: list[int] | tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A long tensor of host ints written on `device` by fill kernels: `torch.tensor(values, device=cuda)` is a
    host-to-device copy, which CUDA-graph capture refuses (a forward replayed as a graph bakes the ints in, and
    they are part of its signature). `out[i] = value` is such a copy too (a host scalar tensor copied in, as the
    H200 showed); `fill_` passes the value to the kernel as an argument."""
    out = torch.empty(len(values), dtype=torch.long, device=device)
    for i, value in enumerate(values):
        out[i].fill_(value)
    return out


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    return ("V", value)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def flatten_call(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """(args, ((name, value), ...)) with keyword arguments in name order: every tensor, positional or keyword,
    is then found by `_tensors` in the same order at capture and at replay."""
    return (tuple(args), tuple(sorted(kwargs.items())))


def _rebuild(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with its tensors (in `_tensors` order) replaced by the next items of `tensors`."""
    if isinstance(value, torch.Tensor):
        return tensors.pop(0)
    if isinstance(value, (tuple, list)):
        return type(value)(_rebuild(v, tensors) for v in value)
    return value


class _Captured:
    def __init__(self, fn: Callable[..., torch.Tensor], inputs: tuple, pool: Any, warmup: int):
        self.static_inputs = [t.clone() for t in _tensors(inputs)]
        s_args, s_items = _rebuild(inputs, list(self.static_inputs))
        s_kwargs = dict(s_items)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn(*s_args, **s_kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.static_output = fn(*s_args, **s_kwargs)

    def replay(self, inputs: tuple) -> torch.Tensor:
        for dst, src in zip(self.static_inputs, _tensors(inputs), strict=True):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.static_output.clone()


class CUDAGraphRunner:
    """Call `fn(*args, **kwargs)` through one captured CUDA graph per input signature (all graphs share a pool).

    `fn` must be a pure function of its tensor arguments (module parameters are read in place), and must not
    synchronize with the host. Non-tensor arguments become part of the signature. At most `max_graphs` graphs
    are kept; a new signature beyond that evicts the least recently used one.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], *, warmup: int = 2, max_graphs: int = 8):
        self.fn = fn
        self.warmup = warmup
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[Any, _Captured] = OrderedDict()
        self.pool = None
        self.captures = 0
        """Graphs captured so far (a signature evicted and seen again is captured again)."""

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        inputs = flatten_call(args, kwargs)
        key = _signature(inputs)
        captured = self.graphs.get(key)
        if captured is None:
            if len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            captured = self.graphs[key] = _Captured(self.fn, inputs, self.pool, self.warmup)
            self.captures += 1
        else:
            self.graphs.move_to_end(key)
        return captured.replay(inputs)

    def reset(self) -> None:
        """Drop every captured graph and its memory."""
        self.graphs.clear()
        self.pool = None
