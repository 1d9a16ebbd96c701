"""Distributed layerwise offload (DLO): data-parallel ranks each keep 1/N of the DiT's repeated blocks on their
device and reassemble a block just before it runs.

With `dlo_use_allgather` (the default) every offloaded block is packed (`layerwise.PackedBlock`, padded to a
multiple of N) and each rank keeps one contiguous 1/N shard of it; the block's pre-hook waits for an all-gather
of the shards issued while the block before it ran. Without it, block i is kept whole by rank i mod N and
broadcast from there (fewer, larger messages; uneven when N does not divide the block count). Either way the
block's full weights exist on a rank only while it runs, and the first `dlo_resident_layers` blocks stay whole
on every rank.

Every rank of the group must run the same blocks in the same order, so the ranks run in waves: one request per
rank, all of compatible shape, CFG, denoise schedule, output count and LoRA (see `dlo_wave_error`). A rank
with no request of its own runs a copy of another's and drops the result.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from vllm_omni.diffusion.offload.layerwise import Fetch, LayerwiseOffloader, PackedBlock, repeated_blocks
from vllm_omni.errors import OmniClientError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from vllm_omni.diffusion.request import OmniDiffusionRequest


class ShardFetch(Fetch):
    """Blocks reassembled from the group's ranks: all-gathered shards, or broadcast from the owning rank."""

    def __init__(
        self, packed: list[PackedBlock], device: torch.device, group: ProcessGroup | None, use_allgather: bool
    ) -> None:
        self.device = device
        self.group = group
        self.use_allgather = use_allgather
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.kept: list[dict[torch.dtype, torch.Tensor] | None] = []
        """What this rank keeps of each block: its shards (all-gather), the whole block if it owns it, or None."""
        for index, block in enumerate(packed):  # block by block: the full model is never held twice
            if use_allgather:
                flats = block.pack("cpu")
                self.kept.append(
                    {dtype: flat.chunk(self.world)[self.rank].to(device, copy=True) for dtype, flat in flats.items()}
                )
            else:
                self.kept.append(block.pack(device) if self._owner(index) == self.rank else None)
            block.release(torch.device("cpu"))
        self.sizes = [block.sizes for block in packed]

    def _owner(self, index: int) -> int:
        return index % self.world

    def start(self, index: int) -> Any:
        flats, works = {}, []
        kept = self.kept[index]
        for dtype, size in self.sizes[index].items():
            if self.use_allgather:
                flats[dtype] = torch.empty(size, dtype=dtype, device=self.device)
                works.append(dist.all_gather_single(flats[dtype], kept[dtype], group=self.group, async_op=True))
            else:
                flats[dtype] = kept[dtype] if kept is not None else torch.empty(size, dtype=dtype, device=self.device)
                src = (
                    dist.get_global_rank(self.group, self._owner(index))
                    if self.group is not None
                    else self._owner(index)
                )
                works.append(dist.broadcast(flats[dtype], src=src, group=self.group, async_op=True))
        return flats, works

    def wait(self, handle: Any) -> dict[torch.dtype, torch.Tensor]:
        flats, works = handle
        for work in works:
            work.wait()
        return flats

    def kept_bytes(self) -> int:
        """Device bytes this rank keeps of the offloaded blocks."""
        return sum(t.numel() * t.element_size() for kept in self.kept if kept is not None for t in kept.values())


def apply_distributed_layerwise_offload(
    model: nn.Module,
    device: torch.device,
    group: ProcessGroup | None = None,
    resident_layers: int = 0,
    use_allgather: bool = True,
    prefetch: int = 1,
) -> LayerwiseOffloader:
    """Shard `model`'s repeated blocks (all but the first `resident_layers`) over `group` (None = the world) and
    move the rest of `model` to `device`; every rank must call it with the same weights."""
    blocks = repeated_blocks(model)
    align = dist.get_world_size(group) if use_allgather else 1
    offloader = LayerwiseOffloader(
        blocks,
        device,
        resident_layers,
        prefetch,
        lambda packed: ShardFetch(packed, device, group, use_allgather),
        align=align,
    )
    model.to(device)
    model._layerwise_offloader = offloader
    return offloader


def dlo_wave_key(request: OmniDiffusionRequest) -> Hashable:
    """What must be equal across one wave's requests for every rank to run the same collectives, and what the
    scheduler forms waves by: the batch key (shape, CFG, denoise schedule, output count, extra_args: what a
    co-batched forward needs equal) with the LoRA adapters (one rank whose adapter fails to load would leave its
    peers waiting in a block's all-gather)."""
    from vllm_omni.diffusion.core.batch_key import build_request_batch_sampling_params_key

    return build_request_batch_sampling_params_key(request, lora=True)


def dlo_wave_error(requests: list[OmniDiffusionRequest]) -> OmniClientError | None:
    """Why `requests` cannot run as one DLO wave (checked before anything is dispatched), or None."""
    for request in requests:
        if not request.prompt_text.strip():
            return OmniClientError(
                f"request {request.request_id}: distributed layerwise offload needs a non-empty prompt "
                "(every rank of the wave must run the same blocks)",
                param="prompt",
            )
        if request.sampling_params.quality in ("high", "fast"):
            return OmniClientError(
                f"request {request.request_id}: quality={request.sampling_params.quality} runs TeaCache, which skips "
                "the blocks at steps it picks from the request's own data; the ranks of a distributed-layerwise-"
                "offload wave must run the same blocks (use quality=lossless or leave it unset)",
                param="quality",
            )
    if len({dlo_wave_key(request) for request in requests}) > 1:
        return OmniClientError(
            "the requests of one distributed-layerwise-offload wave must have compatible shape, CFG, denoise "
            "schedule, output count, and LoRA settings (and equal extra_args): their ranks all-gather every block "
            "together"
        )
    return None
