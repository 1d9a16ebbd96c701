"""Sequence-parallel attention: Ulysses (all-to-all over heads), ring (K/V passed around, log-sum-exp merge),
AllGather-KV (every rank gathers the K/V shards) and the products (Ulysses inside, ring or AllGather-KV
outside), over joint text + image sequences.

Each sequence-parallel rank holds a shard of the image/video tokens and ALL the text tokens (`joint_len` of
them at the front or the rear of q/k/v), as in xDiT's USP. Ulysses turns the image shard into the whole
(ring-chunk of the) sequence for H/u heads and takes the same H/u heads of the replicated text; after the
attention the image part goes back to its shard and the text part's heads are all-gathered, so every rank
ends with the same text output. Ring attention keeps the queries local and visits every rank's image K/V
block, plus the text K/V once. AllGather-KV gathers the image K/V shards of its group (the K/V heads only: GQA
stays compressed in the transfer) and attends the local queries over them and the text K/V in one call.

Ulysses `advanced_uaa` mode: when the Ulysses degree does not divide the K/V heads, zero heads are appended to
K/V (and as many groups of query heads as GQA needs, so query head i still reads K/V head i // group) up to a
multiple of the degree; the padded heads' outputs are dropped after the attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vllm_omni.diffusion.distributed.sequence import heads_to_seq, seq_to_heads

if TYPE_CHECKING:
    from vllm.distributed.parallel_state import GroupCoordinator

    from vllm_omni.diffusion.distributed.parallel_state import DiffusionParallelGroups

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _split_joint(x: torch.Tensor, joint_len: int, front: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(sharded part, replicated text part)."""
    if front:
        return x[:, joint_len:], x[:, :joint_len]
    return x[:, : x.shape[1] - joint_len], x[:, x.shape[1] - joint_len :]


def _join(sharded: torch.Tensor, joint: torch.Tensor, front: bool) -> torch.Tensor:
    return torch.cat([joint, sharded] if front else [sharded, joint], dim=1)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention of (B, S, H, D) tensors in fp32 and its log-sum-exp (B, H, S, 1).

    GQA/MQA: K/V heads are repeated to the query heads here, after any communication (which stays H_kv wide).
    """
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} must be divisible by num_kv_heads={kv_heads}")
    qf, kf, vf = (t.transpose(1, 2).float() for t in (q, k, v))
    if kv_heads != heads:
        kf, vf = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (kf, vf))
    scores = qf @ kf.transpose(-1, -2) * scale
    lse = scores.logsumexp(dim=-1, keepdim=True)
    return ((scores - lse).exp() @ vf).transpose(1, 2), lse


def _merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    w_old, w_new = ((x - new_lse).exp().transpose(1, 2) for x in (lse, block_lse))
    return out * w_old + block_out * w_new, new_lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: GroupCoordinator, scale: float,
                   joint_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Local queries against every ring rank's K/V block (received from the previous rank, sent to the next,
    overlapped with the block being computed), plus the replicated `joint_kv` once; output in q's dtype."""
    out = lse = None
    if joint_kv is not None and joint_kv[0].shape[1]:
        out, lse = attention_with_lse(q, *joint_kv, scale)
    kv = torch.stack([k, v]).contiguous()
    nxt, prv = group.next_rank, group.prev_rank
    for step in range(group.world_size):
        pending = []
        if step + 1 < group.world_size:
            incoming = torch.empty_like(kv)
            pending = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, kv, nxt, group.device_group),
                dist.P2POp(dist.irecv, incoming, prv, group.device_group),
            ])
        out, lse = _merge(out, lse, *attention_with_lse(q, kv[0], kv[1], scale))
        for work in pending:
            work.wait()
        if pending:
            kv = incoming
    return out.to(q.dtype)


def sequence_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: DiffusionParallelGroups,
                                attend: Attend, scale: float, joint_len: int = 0, joint_front: bool = False
                                ) -> torch.Tensor:
    """USP over this rank's q/k/v (B, S_local + joint_len, H, D): Ulysses within `groups.ulysses`, then ring
    attention within `groups.ring` (or the plain backend `attend` when the ring has one rank)."""
    uly, ring, gather = groups.ulysses, groups.ring, groups.allgather
    heads = q.shape[2]
    if uly.world_size > 1 and k.shape[2] % uly.world_size:  # advanced_uaa (the layer refused it otherwise)
        q, k, v = _pad_heads(q, k, v, uly.world_size)
    (q_s, q_j), (k_s, k_j), (v_s, v_j) = (_split_joint(t, joint_len, joint_front) for t in (q, k, v))
    if uly.world_size > 1:
        q_s, k_s, v_s = (seq_to_heads(t, uly) for t in (q_s, k_s, v_s))
        q_j, k_j, v_j = (_head_slice(t, uly) for t in (q_j, k_j, v_j))
    if ring.world_size > 1:
        out = ring_attention(_join(q_s, q_j, joint_front), k_s, v_s, ring, scale, joint_kv=(k_j, v_j))
    else:
        if gather.world_size > 1:  # one all-gather of K and V together, along the sequence
            k_s, v_s = gather.all_gather(torch.stack([k_s, v_s]).contiguous(), dim=2).unbind(0)
        out = attend(_join(q_s, q_j, joint_front), _join(k_s, k_j, joint_front), _join(v_s, v_j, joint_front))
    if uly.world_size == 1:
        return out
    out_s, out_j = _split_joint(out, joint_len, joint_front)
    out_s = heads_to_seq(out_s.contiguous(), uly)
    out_j = uly.all_gather(out_j.contiguous(), dim=2) if joint_len else out_j.new_empty(out_s.shape[0], 0,
                                                                                         *out_s.shape[2:])
    return _join(out_s, out_j, joint_front)[:, :, :heads]


def _pad_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, degree: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero heads appended to K/V up to a multiple of `degree`, and to q as GQA's grouping needs."""
    kv_heads = k.shape[2]
    padded_kv = -(-kv_heads // degree) * degree
    padded_q = padded_kv * (q.shape[2] // kv_heads)
    return (F.pad(q, (0, 0, 0, padded_q - q.shape[2])), F.pad(k, (0, 0, 0, padded_kv - kv_heads)),
            F.pad(v, (0, 0, 0, padded_kv - kv_heads)))


def _head_slice(x: torch.Tensor, group: GroupCoordinator) -> torch.Tensor:
    """This Ulysses rank's heads of a replicated tensor (the text part)."""
    return x.chunk(group.world_size, dim=2)[group.rank_in_group]
