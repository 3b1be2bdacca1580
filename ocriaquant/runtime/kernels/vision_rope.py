"""The vision tower's rotary embedding and attention layout in one launch: the qkv projection's rows
[S, 3·H·D] in, q and k rotated and v copied out as [3, H, S, D] (each a contiguous [1, H, S, D] for
SDPA). transformers' apply_rotary_pos_emb_vision casts q and k to fp32, builds rotate_half with a
cat and a negation, multiplies, adds and casts back, after an unbind and before the transposes:
about ten passes over [S, H, D] a layer, 13 ms of a 4.1 MP page on an H200. Same math and
roundings here (fp32, rounded to the input dtype once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import round_bf16
from .splitk import interpreted


@triton.jit
def _vision_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, S, H, stride_qkv, HALF: tl.constexpr,
                        BH: tl.constexpr, BS: tl.constexpr, INTERPRET: tl.constexpr):
    th = tl.program_id(1)  # which of q, k, v (th // H) and its head (th % H)
    t = th // H
    h = th % H
    D = 2 * HALF
    rs = tl.program_id(0) * BS + tl.arange(0, BS)
    rd = tl.arange(0, BH)  # BH: HALF to the next power of two
    m = (rs < S)[:, None] & (rd < HALF)[None, :]
    src = qkv_ptr + rs[:, None] * stride_qkv + (t * H + h) * D + rd[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    if t < 2:  # q, k: x·cos + rotate_half(x)·sin, rotate_half(x) = [-x2, x1]
        cs = rs[:, None] * D + rd[None, :]
        c1 = tl.load(cos_ptr + cs, mask=m, other=0.0)
        c2 = tl.load(cos_ptr + cs + HALF, mask=m, other=0.0)
        s1 = tl.load(sin_ptr + cs, mask=m, other=0.0)
        s2 = tl.load(sin_ptr + cs + HALF, mask=m, other=0.0)
        y1 = x1 * c1 + (-x2) * s1
        y2 = x2 * c2 + x1 * s2
    else:
        y1 = x1
        y2 = x2
    if INTERPRET:  # its own cast truncates (rounding.py): round first, the store's cast is then exact
        y1 = round_bf16(y1)
        y2 = round_bf16(y2)
    dst = out_ptr + ((t * H + h) * S + rs[:, None]) * D + rd[None, :]
    tl.store(dst, y1.to(out_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF, y2.to(out_ptr.dtype.element_ty), mask=m)


def vision_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, block_s: int = 64):
    """qkv bf16 [S, 3·H·D] (rows contiguous), cos and sin fp32 [S, D] -> q, k, v bf16, each a
    contiguous [1, H, S, D]: q and k rotated as transformers' vision rope does, v as it was."""
    S, width = qkv.shape
    D = width // (3 * heads)
    if width != 3 * heads * D or D % 2 or qkv.stride(-1) != 1 or qkv.dtype != torch.bfloat16 \
            or cos.shape != (S, D) or sin.shape != (S, D) or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"vision_rope: qkv {tuple(qkv.shape)} {qkv.dtype} must be bf16 [S, 3·{heads}·D] with "
                         f"contiguous rows, cos {tuple(cos.shape)} and sin {tuple(sin.shape)} fp32 [S, D]")
    out = torch.empty(3, heads, S, D, dtype=qkv.dtype, device=qkv.device)
    _vision_rope_kernel[(triton.cdiv(S, block_s), 3 * heads)](
        qkv, cos.contiguous(), sin.contiguous(), out, S, heads, qkv.stride(0), HALF=D // 2,
        BH=triton.next_power_of_2(D // 2), BS=block_s,
        INTERPRET=interpreted(), num_warps=4)
    return out[0:1], out[1:2], out[2:3]
