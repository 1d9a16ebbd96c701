"""q/k RMSNorm + rotary embedding + the text/image join of an MMDiT block, as one pass over the q/k/v projection.

Between a block's q/k/v projections and its attention, eager code makes several passes over the three
(tokens, heads * head_dim) tensors: normalize q and k per head, rotate them in float32, then concatenate the text
and image streams. Inductor fuses the first two but still writes separately from the concat, and an H200 profile
of Qwen-Image at 1024² put this prologue at ~8% of the forward. On CUDA one Triton kernel reads each stream's
projection once and writes attention-ready q/k/v straight into the joint buffers (both streams in one launch);
elsewhere the same math runs as torch ops. Numerics: everything in float32, rounded once (the eager path rounds
after the norm too).

Rotary tables are per channel pair: `cos`, `sin` of shape (tokens, head_dim / 2), pairs are adjacent channels
(2j, 2j+1) — the layout FLUX and Qwen-Image use.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; without it only the torch path exists.
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _qk_norm_rope_kernel(src0, src0_sb, src0_ss, wq0, wk0, cos0, sin0,
                             src1, src1_sb, src1_ss, wq1, wk1, cos1, sin1,
                             q_out, k_out, v_out, out_sb, out_ss, seq0, total, eps,
                             HD: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr):
        """One program per (token, part): all heads of that token's q (part 0), k (1) or v (2).

        Tokens [0, seq0) of each joint row come from segment 0, the rest from segment 1: both streams in one
        launch."""
        row = tl.program_id(0)
        part = tl.program_id(1)
        b = row // total
        s = row - b * total
        if s < seq0:
            src = src0 + b * src0_sb + s * src0_ss
            wq, wk = wq0, wk0
            cos = cos0 + s * (D // 2)
            sin = sin0 + s * (D // 2)
        else:
            t = s - seq0
            src = src1 + b * src1_sb + t * src1_ss
            wq, wk = wq1, wk1
            cos = cos1 + t * (D // 2)
            sin = sin1 + t * (D // 2)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, D)
        mask = (h < H)[:, None]
        cols = h[:, None] * D + d[None, :]
        x = tl.load(src + part * HD + cols, mask=mask, other=0.0)
        dst = b * out_sb + s * out_ss + cols
        if part == 2:
            tl.store(v_out + dst, x, mask=mask)
        else:
            xf = x.to(tl.float32)
            inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
            if part == 0:
                w = tl.load(wq + d).to(tl.float32)
            else:
                w = tl.load(wk + d).to(tl.float32)
            y = xf * inv_rms[:, None] * w[None, :]
            even, odd = tl.split(tl.reshape(y, (BLOCK_H, D // 2, 2)))
            j = tl.arange(0, D // 2)
            c = tl.load(cos + j)[None, :]
            sn = tl.load(sin + j)[None, :]
            out = tl.reshape(tl.join(even * c - odd * sn, even * sn + odd * c), (BLOCK_H, D))
            if part == 0:
                tl.store(q_out + dst, out.to(q_out.dtype.element_ty), mask=mask)
            else:
                tl.store(k_out + dst, out.to(k_out.dtype.element_ty), mask=mask)


def _segments(txt_qkv, img_qkv, txt_weights, img_weights, txt_rope, img_rope, text_first):
    """(qkv, (q_weight, k_weight), (cos, sin)) per stream present, in joint order."""
    segments = [(img_qkv, img_weights, img_rope)]
    if txt_qkv is not None:
        segments.insert(0 if text_first else 1, (txt_qkv, txt_weights, txt_rope))
    return segments


def _reference_segment(qkv, weights, rope, num_heads, eps):
    head_dim = weights[0].shape[0]
    q, k, v = qkv[..., : 3 * num_heads * head_dim].unflatten(-1, (3, num_heads, head_dim)).unbind(2)
    cos, sin = (t[None, :, None, :] for t in rope)

    def norm_rope(x, weight):
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).to(qkv.dtype)

    return norm_rope(q, weights[0]), norm_rope(k, weights[1]), v


@torch.library.custom_op("vllm_omni::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(txt_qkv: torch.Tensor | None, img_qkv: torch.Tensor, txt_q_weight: torch.Tensor | None,
                     txt_k_weight: torch.Tensor | None, img_q_weight: torch.Tensor, img_k_weight: torch.Tensor,
                     txt_cos: torch.Tensor | None, txt_sin: torch.Tensor | None, img_cos: torch.Tensor,
                     img_sin: torch.Tensor, num_heads: int, eps: float, text_first: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    segments = _segments(txt_qkv, img_qkv, (txt_q_weight, txt_k_weight), (img_q_weight, img_k_weight),
                         (txt_cos, txt_sin), (img_cos, img_sin), text_first)
    head_dim = img_q_weight.shape[0]
    if not img_qkv.is_cuda or triton is None or head_dim & (head_dim - 1):  # the kernel tiles powers of two
        parts = [_reference_segment(qkv, w, r, num_heads, eps) for qkv, w, r in segments]
        return tuple(torch.cat(p, dim=1) for p in zip(*parts, strict=True))  # type: ignore[return-value]
    return _triton_qk_norm_rope(segments, num_heads, eps)


def _triton_qk_norm_rope(segments, num_heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    segments = [(qkv if qkv.stride(-1) == 1 else qkv.contiguous(), w, r) for qkv, w, r in segments]
    first_qkv, (first_wq, _), _ = segments[0]
    head_dim = first_wq.shape[0]
    batch = first_qkv.shape[0]
    seq0 = first_qkv.shape[1]
    total = sum(qkv.shape[1] for qkv, _, _ in segments)
    q, k, v = (first_qkv.new_empty(batch, total, num_heads, head_dim) for _ in range(3))
    # A single segment fills the whole row: segment 1's arguments are never read.
    args = [(qkv, qkv.stride(0), qkv.stride(1), wq, wk, cos, sin) for qkv, (wq, wk), (cos, sin) in segments]
    _qk_norm_rope_kernel[(batch * total, 3)](
        *args[0], *args[-1], q, k, v, q.stride(0), q.stride(1), seq0, total, eps,
        HD=num_heads * head_dim, H=num_heads, D=head_dim, BLOCK_H=triton.next_power_of_2(num_heads), num_warps=4,
    )
    return q, k, v


@_qk_norm_rope_op.register_fake
def _(txt_qkv, img_qkv, txt_q_weight, txt_k_weight, img_q_weight, img_k_weight, txt_cos, txt_sin, img_cos, img_sin,
      num_heads, eps, text_first):
    total = img_qkv.shape[1] + (txt_qkv.shape[1] if txt_qkv is not None else 0)
    shape = (img_qkv.shape[0], total, num_heads, img_q_weight.shape[0])
    return tuple(img_qkv.new_empty(shape) for _ in range(3))


def qk_norm_rope(img_qkv: torch.Tensor, img_norms: tuple[torch.Tensor, torch.Tensor],
                 img_rope: tuple[torch.Tensor, torch.Tensor], *, num_heads: int, eps: float,
                 txt_qkv: torch.Tensor | None = None, txt_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
                 txt_rope: tuple[torch.Tensor, torch.Tensor] | None = None, text_first: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention-ready (q, k, v), each (batch, txt_len + img_len, num_heads, head_dim), text first unless
    `text_first=False`.

    `*_qkv` is a projection output (batch, seq, >= 3 * num_heads * head_dim) whose first columns are q | k | v;
    `*_norms` the RMSNorm weights (head_dim,) of q and k; `*_rope` the (cos, sin) pair tables of that stream.
    Without `txt_qkv`, `img_qkv` is the whole (already joined) sequence.
    """
    txt_norms = txt_norms or (None, None)
    txt_rope = txt_rope or (None, None)
    return _qk_norm_rope_op(txt_qkv, img_qkv, txt_norms[0], txt_norms[1], img_norms[0], img_norms[1],
                            txt_rope[0], txt_rope[1], img_rope[0], img_rope[1], num_heads, eps, text_first)
