"""Qwen3.5 attention's decode prologue in one launch: per-head RMSNorm of q and k, M-RoPE on
their first `rot` dims, and the new token's k and v written into the per-slot KV cache.

In torch this is ~40 kernels per attention layer (two RMSNorms of ~7 ops, rotate_half's
slices, negation and concatenations, the products and sums for q and k, two index_put
writes); at batch 1 each costs more in launch than in bytes. Here one program per (row, head)
does it: q heads write the normed, rotated query, KV heads write k and v into the cache at
(slot, head, lengths[b]).

Rounding is torch's on BF16 tensors: the norm in fp32 cast back to bf16, then each RoPE
product and the sum rounded to bf16 (rounding.round_bf16, which is also right under the
interpreter), so the triton backend's tokens stay those of the torch backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import round_bf16
from .splitk import start_after_producer, use_pdl

WARPS = 2  # warps per (row, head) program


@triton.jit
def _norm_rope(src, w_ptr, cos_ptr, sin_ptr, eps, HD, ROT, BD: tl.constexpr):
    """One head: zero-centred RMSNorm (x / rms · (1 + w)), then rotate_half RoPE on [0, ROT)."""
    rd = tl.arange(0, BD)
    dmask = rd < HD
    x = tl.load(src + rd, mask=dmask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / HD + eps)
    n = round_bf16(x * r * (1.0 + tl.load(w_ptr + rd, mask=dmask, other=0.0).to(tl.float32)))
    half = ROT // 2
    rmask = rd < ROT
    partner = tl.where(rd < half, rd + half, rd - half)  # rotate_half's source index
    xp = tl.load(src + partner, mask=rmask, other=0.0).to(tl.float32)
    np_ = round_bf16(xp * r * (1.0 + tl.load(w_ptr + partner, mask=rmask, other=0.0).to(tl.float32)))
    c = tl.load(cos_ptr + rd, mask=rmask, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + rd, mask=rmask, other=0.0).to(tl.float32)
    e = round_bf16(round_bf16(n * c) + round_bf16(tl.where(rd < half, -np_, np_) * s))
    return tl.where(rmask, e, n)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr,
                         len_ptr, stride_qb, stride_qh, stride_kb, stride_vb, stride_cb, c_stride_slot, c_stride_h,
                         c_stride_t, HEADS, HD, ROT, eps, BD: tl.constexpr, PDL: tl.constexpr):
    start_after_producer(PDL)  # q, k, v come from the GEMV before this kernel
    b = tl.program_id(0)
    h = tl.program_id(1)
    rd = tl.arange(0, BD)
    dmask = rd < HD
    cos = cos_ptr + b * stride_cb
    sin = sin_ptr + b * stride_cb
    if h < HEADS:
        y = _norm_rope(q_ptr + b * stride_qb + h * stride_qh, qw_ptr, cos, sin, eps, HD, ROT, BD)
        tl.store(qo_ptr + (b * HEADS + h) * HD + rd, y.to(qo_ptr.dtype.element_ty), mask=dmask)
    else:
        j = h - HEADS
        y = _norm_rope(k_ptr + b * stride_kb + j * HD, kw_ptr, cos, sin, eps, HD, ROT, BD)
        dst = tl.load(slot_ptr + b).to(tl.int64) * c_stride_slot + j * c_stride_h + \
            tl.load(len_ptr + b).to(tl.int64) * c_stride_t + rd
        tl.store(kc_ptr + dst, y.to(kc_ptr.dtype.element_ty), mask=dmask)
        tl.store(vc_ptr + dst, tl.load(v_ptr + b * stride_vb + j * HD + rd, mask=dmask, other=0.0), mask=dmask)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                 pdl: bool | None = None) -> torch.Tensor:
    """q [B, heads, hd] (head stride free: the q half of q_proj's interleaved q/gate output),
    k, v [B, KV heads · hd] (row stride free: views of a fused qkv output), norm weights [hd],
    cos/sin [B, rot]; caches [slots, KV heads, max_len, hd]; slots, lengths int32 [B].
    Returns the normed, rotated q [B, heads, hd]; k and v go to the cache at lengths[b].
    pdl: as splitk.use_pdl."""
    bsz, heads, hd = q.shape
    kvh = k_cache.shape[1]
    rot = cos.shape[-1]
    if (q.stride(2) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or k.shape[-1] != kvh * hd
            or k_cache.shape[-1] != hd or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1
            or rot > hd or rot % 2 or cos.stride(-1) != 1 or cos.stride() != sin.stride()):
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} do not fit "
                         f"the cache {tuple(k_cache.shape)}")
    q_out = torch.empty(bsz, heads, hd, dtype=q.dtype, device=q.device)
    pdl = use_pdl(q.device, pdl)
    _qk_norm_rope_kernel[(bsz, heads + kvh)](
        q, k, v, q_weight, k_weight, cos, sin, q_out, k_cache, v_cache, slots, lengths, q.stride(0), q.stride(1),
        k.stride(0), v.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), heads, hd,
        rot, eps, BD=triton.next_power_of_2(hd), num_warps=WARPS, PDL=pdl, launch_pdl=pdl)
    return q_out

