"""What each rank runs in the AllGather-KV / Ulysses advanced_uaa tests (importable by name for the spawned
ranks)."""

from __future__ import annotations

import torch

Case = tuple[int, int, bool]
"""(query heads, K/V heads, text at the front)."""


def sharded_attention_errors(cases: list[Case], seed: int = 0) -> dict[Case, float | str]:
    """Per case: the largest difference between this layout's sharded joint attention (gathered back) and
    whole-sequence SDPA on the same q/k/v, or the ValueError the layer raised when it was built."""
    import torch.nn.functional as F

    from vllm_omni.diffusion.attention.layer import Attention
    from vllm_omni.diffusion.distributed.sequence import gather_sequence, shard_sequence

    torch.manual_seed(seed)
    batch, img, txt, dim = 2, 8, 3, 8
    results: dict[Case, float | str] = {}
    for heads, kv_heads, front in cases:
        q = torch.randn(batch, img + txt, heads, dim)
        k, v = (torch.randn(batch, img + txt, kv_heads, dim) for _ in range(2))
        want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                              enable_gqa=kv_heads != heads).transpose(1, 2)

        def split(t: torch.Tensor, front: bool = front) -> tuple[torch.Tensor, torch.Tensor]:
            return (t[:, txt:], t[:, :txt]) if front else (t[:, :-txt], t[:, -txt:])

        def join(s: torch.Tensor, j: torch.Tensor, front: bool = front) -> torch.Tensor:
            return torch.cat([j, s] if front else [s, j], 1)

        try:
            layer = Attention(heads, dim, num_kv_heads=kv_heads)
        except ValueError as exc:
            results[(heads, kv_heads, front)] = str(exc)
            continue
        local = [join(shard_sequence(s), j) for s, j in map(split, (q, k, v))]
        out_s, out_j = split(layer(*local, joint_len=txt, joint_front=front))
        assert out_s.shape[2] == heads
        results[(heads, kv_heads, front)] = float((join(gather_sequence(out_s), out_j) - want).abs().max())
    return results
