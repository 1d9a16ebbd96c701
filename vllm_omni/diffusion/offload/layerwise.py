"""Layerwise offload: a DiT's repeated blocks live off the device and are fetched just before they run.

Each block's parameters and buffers are packed into one flat tensor per dtype. Between forwards a block's
tensors are empty placeholders; its forward pre-hook waits for the block's fetch (issued one or more blocks
earlier, so the copy runs while the previous block computes), points the tensors at the fetched buffers and
issues the fetch of the next blocks; its forward hook drops the buffers again. A fetch is a host-to-device copy
from pinned memory on a side stream (`HostFetch`, one device), or a collective that reassembles the block from
the shards the data-parallel ranks hold (`distributed.py`). Submodules that a model calls outside its block's
forward (Qwen-Image and FLUX compute every block's adaLN modulation for all steps at once) fetch the block
synchronously for that call.

Why not diffusers' `apply_group_offloading`: its streamed path refuses a CPU onload device (so nothing of it
could run in CPU CI), it offloads every ModuleList and the model's other parameters too, prefetches exactly
one group, keeps no layers resident, and synchronizes the host after every block; here the first
`resident_layers` blocks never move and only the repeated blocks are offloaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """`model`'s repeated transformer blocks (the classes in `model._repeated_blocks`) in execution order:
    the items of its ModuleLists of such blocks, list by list as registered."""
    names = set(getattr(model, "_repeated_blocks", ()))
    if not names:
        raise ValueError(f"{type(model).__name__} declares no _repeated_blocks to offload")
    blocks = [
        block
        for module in model.modules()
        if isinstance(module, nn.ModuleList)
        for block in module
        if type(block).__name__ in names
    ]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no ModuleList of its _repeated_blocks {sorted(names)}")
    return blocks


@dataclass(frozen=True)
class _Slot:
    module: nn.Module
    name: str
    is_param: bool
    shape: torch.Size
    offset: int
    """In elements of its dtype's flat tensor."""


class PackedBlock:
    """One block's tensors as one flat tensor per dtype, and the views that make the block use a fetched set."""

    def __init__(self, block: nn.Module, align: int = 1) -> None:
        """`align`: every flat tensor is zero-padded to a multiple of it (the ranks' shard count)."""
        self.slots: dict[torch.dtype, list[_Slot]] = {}
        sizes: dict[torch.dtype, int] = {}
        for module in block.modules():
            for is_param, tensors in ((True, module._parameters), (False, module._buffers)):
                for name, tensor in tensors.items():
                    if tensor is None:
                        continue
                    offset = sizes.get(tensor.dtype, 0)
                    self.slots.setdefault(tensor.dtype, []).append(_Slot(module, name, is_param, tensor.shape, offset))
                    sizes[tensor.dtype] = offset + tensor.numel()
        self.sizes = {dtype: -(-size // align) * align for dtype, size in sizes.items()}

    def pack(self, device: torch.device | str = "cpu", pin: bool = False) -> dict[torch.dtype, torch.Tensor]:
        """The block's current tensors copied into new flat tensors on `device` (in pinned host memory: `pin`)."""
        flats = {
            dtype: torch.zeros(size, dtype=dtype, device=device, pin_memory=pin) for dtype, size in self.sizes.items()
        }
        for dtype, slots in self.slots.items():
            for slot in slots:
                tensor = self._get(slot)
                flats[dtype][slot.offset : slot.offset + tensor.numel()].copy_(tensor.reshape(-1))
        return flats

    def bind(self, flats: dict[torch.dtype, torch.Tensor]) -> None:
        """Point every tensor of the block at its view of `flats`."""
        for dtype, slots in self.slots.items():
            for slot in slots:
                numel = slot.shape.numel()
                self._set(slot, flats[dtype][slot.offset : slot.offset + numel].view(slot.shape))

    def release(self, device: torch.device) -> None:
        """Replace every tensor by an empty placeholder on `device` (a use before the next `bind` fails loudly
        on its shape)."""
        for dtype, slots in self.slots.items():
            empty = torch.empty(0, dtype=dtype, device=device)
            for slot in slots:
                self._set(slot, empty)

    def nbytes(self) -> int:
        return sum(size * dtype.itemsize for dtype, size in self.sizes.items())

    @staticmethod
    def _get(slot: _Slot) -> torch.Tensor:
        store = slot.module._parameters if slot.is_param else slot.module._buffers
        return store[slot.name].data

    @staticmethod
    def _set(slot: _Slot, value: torch.Tensor) -> None:
        if slot.is_param:
            slot.module._parameters[slot.name].data = value
        else:
            slot.module._buffers[slot.name] = value


class Fetch:
    """How a block's flat tensors reach the device: `start` issues the transfer (asynchronously where the
    device allows), `wait` makes the current stream wait for it and returns the tensors."""

    def start(self, index: int) -> Any:
        raise NotImplementedError

    def wait(self, handle: Any) -> dict[torch.dtype, torch.Tensor]:
        raise NotImplementedError


class HostFetch(Fetch):
    """Blocks in host memory (pinned when the device is CUDA), copied in on a side stream."""

    def __init__(self, packed: list[PackedBlock], device: torch.device) -> None:
        self.device = device
        self.host = []
        for block in packed:  # one block at a time: host memory holds the model plus one block's copy, not two models
            self.host.append(block.pack("cpu", pin=device.type == "cuda"))
            block.release(torch.device("cpu"))
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, index: int) -> Any:
        if self.stream is None:  # CPU: the copy runs inline; what it hides behind is the CUDA path's business
            return {dtype: flat.clone() for dtype, flat in self.host[index].items()}, None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # buffers freed by compute are reusable
        with torch.cuda.stream(self.stream):
            flats = {dtype: flat.to(self.device, non_blocking=True) for dtype, flat in self.host[index].items()}
            done = torch.cuda.Event()
            done.record(self.stream)
        return flats, done

    def wait(self, handle: Any) -> dict[torch.dtype, torch.Tensor]:
        flats, done = handle
        if done is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(done)
            for flat in flats.values():  # allocated on the copy stream, freed after compute has read them
                flat.record_stream(compute)
        return flats


class LayerwiseOffloader:
    """Keeps `blocks` (all but the first `resident_layers`) off the device and fetches each `prefetch` blocks
    ahead of its use, in the cyclic order the blocks run (the last block prefetches the first offloaded ones
    for the next step)."""

    def __init__(
        self,
        blocks: list[nn.Module],
        device: torch.device,
        resident_layers: int,
        prefetch: int,
        make_fetch: Callable[[list[PackedBlock]], Fetch],
        align: int = 1,
    ) -> None:
        if resident_layers < 0 or prefetch < 1:
            raise ValueError(f"resident_layers must be >= 0 and prefetch >= 1, got {resident_layers}, {prefetch}")
        self.device = device
        self.blocks = blocks[resident_layers:]
        self.packed = [PackedBlock(block, align) for block in self.blocks]
        self.fetch = make_fetch(self.packed)
        self.prefetch = min(prefetch, max(len(self.blocks) - 1, 0))
        self.pending: dict[int, Any] = {}
        """Fetches issued and not yet waited for, by offloaded-block index."""
        self.owner: dict[int, nn.Module] = {}
        """Offloaded blocks bound on the device, by index: the module whose forward bound them."""
        self.fetches = 0
        """Fetches issued so far (a benchmark's bytes streamed = fetches x block bytes)."""
        for packed in self.packed:
            packed.release(device)
        self._handles = []
        for index, block in enumerate(self.blocks):
            for module in (block, *block.children()):
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(index)))
                self._handles.append(module.register_forward_hook(self._post_hook(index)))

    @property
    def num_offloaded(self) -> int:
        return len(self.blocks)

    def bytes_per_pass(self) -> int:
        """Bytes fetched for one pass over all blocks."""
        return sum(packed.nbytes() for packed in self.packed)

    def _start(self, index: int) -> None:
        if index not in self.pending and index not in self.owner:
            self.pending[index] = self.fetch.start(index)
            self.fetches += 1

    def _pre_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if index in self.owner:  # a submodule inside its bound block's forward
                return
            self._start(index)
            self.packed[index].bind(self.fetch.wait(self.pending.pop(index)))
            self.owner[index] = module
            if module is self.blocks[index]:  # in the block order: fetch the next ones while this one runs
                for ahead in range(1, self.prefetch + 1):
                    self._start((index + ahead) % len(self.blocks))

        return hook

    def _post_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.owner.get(index) is module:
                del self.owner[index]
                self.packed[index].release(self.device)

        return hook

    def remove(self) -> None:
        """Drop the hooks and bind every block back on the device for good (e.g. before unloading)."""
        for handle in self._handles:
            handle.remove()
        for index, packed in enumerate(self.packed):
            if index not in self.owner:
                handle = self.pending.pop(index, None) or self.fetch.start(index)
                packed.bind(self.fetch.wait(handle))
        self.owner.clear()


def iter_offloaders(module: Any) -> Iterator[LayerwiseOffloader]:
    """The offloaders installed on `module`'s submodules (`module._layerwise_offloader`)."""
    if isinstance(module, nn.Module):
        for sub in module.modules():
            offloader = getattr(sub, "_layerwise_offloader", None)
            if offloader is not None:
                yield offloader


def apply_layerwise_offload(
    model: nn.Module, device: torch.device, resident_layers: int = 0, prefetch: int = 1
) -> LayerwiseOffloader:
    """Offload `model`'s repeated blocks (all but the first `resident_layers`) to host memory and move the rest
    of `model` to `device`; `model` may be built on CPU (so it never has to fit the device whole)."""
    blocks = repeated_blocks(model)
    offloader = LayerwiseOffloader(blocks, device, resident_layers, prefetch, lambda packed: HostFetch(packed, device))
    model.to(device)  # the offloaded blocks hold empty placeholders: this moves the resident part only
    model._layerwise_offloader = offloader
    return offloader
