"""Sequence- and CFG-parallel data movement: shard the image/video tokens over the sequence-parallel ranks,
gather them back, swap a sequence shard for a head shard (Ulysses), pick and join the CFG branches.

Every function is the identity when its group has one rank, so model code calls them unconditionally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from vllm_omni.diffusion.distributed.parallel_state import get_diffusion_groups
from vllm_omni.errors import OmniClientError

if TYPE_CHECKING:
    from vllm.distributed.parallel_state import GroupCoordinator


def _sp_group() -> GroupCoordinator | None:
    groups = get_diffusion_groups()
    return None if groups is None or groups.sp.world_size == 1 else groups.sp


def check_sequence_divisible(seq_len: int, what: str = "image tokens", param: str = "height") -> None:
    """A request whose token count the sequence-parallel ranks cannot split evenly is a 400 naming `param`."""
    group = _sp_group()
    if group is not None and seq_len % group.world_size:
        raise OmniClientError(
            f"{seq_len} {what} do not split over sequence_parallel_size={group.world_size} "
            "(--ulysses-degree x --ring-degree); choose a size whose token count is a multiple of it",
            param=param)


def shard_sequence(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous slice of `x` along `dim` (sequence-parallel rank order: ring-major)."""
    group = _sp_group()
    if group is None:
        return x
    check_sequence_divisible(x.shape[dim])
    return x.chunk(group.world_size, dim=dim)[group.rank_in_group].contiguous()


def gather_sequence(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: every rank gets the whole sequence."""
    group = _sp_group()
    return x if group is None else group.all_gather(x.contiguous(), dim=dim)


def seq_to_heads(x: torch.Tensor, group: GroupCoordinator) -> torch.Tensor:
    """(B, S/n, H, D) sequence shard -> (B, S, H/n, D) head shard over `group` (Ulysses all-to-all)."""
    n = group.world_size
    b, s, h, d = x.shape
    send = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group.device_group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def heads_to_seq(x: torch.Tensor, group: GroupCoordinator) -> torch.Tensor:
    """Inverse of `seq_to_heads`: (B, S, H/n, D) -> (B, S/n, H, D)."""
    n = group.world_size
    b, s, h, d = x.shape
    send = x.reshape(b, n, s // n, h, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group.device_group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


def cfg_rank_and_size() -> tuple[int, int]:
    groups = get_diffusion_groups()
    return (0, 1) if groups is None else (groups.cfg.rank_in_group, groups.cfg.world_size)


def cfg_branch_rows(num_positive: int, num_total: int) -> slice:
    """The transformer rows this rank computes: all of them, or under CFG parallel the positive rows
    (`[:num_positive]`, CFG rank 0) or the negative ones (CFG rank 1)."""
    rank, size = cfg_rank_and_size()
    if size == 1 or num_positive == num_total:
        return slice(0, num_total)
    return slice(0, num_positive) if rank == 0 else slice(num_positive, num_total)


def cfg_gather_rows(pred: torch.Tensor, num_positive: int, num_total: int) -> torch.Tensor:
    """Join the branches computed on the CFG ranks into all `num_total` rows (positive first)."""
    rank, size = cfg_rank_and_size()
    if size == 1 or num_positive == num_total:
        return pred
    width = max(num_positive, num_total - num_positive)
    padded = torch.cat([pred, pred.new_zeros(width - pred.shape[0], *pred.shape[1:])])
    joined = get_diffusion_groups().cfg.all_gather(padded, dim=0)
    return torch.cat([joined[:num_positive], joined[width:width + num_total - num_positive]])
