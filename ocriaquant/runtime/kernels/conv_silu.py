"""A GDN layer's causal depthwise conv + SiLU over prefill rows, in one launch: y[t, c] =
silu(Σ_j w[c, j] · x[t + j - (K-1), c]), the taps before the chunk's first row read from the
slot's conv state (its last K-1 inputs) or zero for a prompt's first chunk.

The torch path transposes the rows to channels, concatenates the history, runs cuDNN's depthwise
conv1d (its generic kernel at these shapes) and SiLU, and transposes back: four passes over the
[n, C] block and a copy for each. Here the rows are read where the projection wrote them (any
row stride: a view of a fused projection's output) and written once. Numerics as the torch
reference (reference.conv_silu_ref): the sum in fp32, rounded to bf16, then SiLU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import round_bf16
from .splitk import interpreted


@triton.jit
def _conv_silu_kernel(x_ptr, h_ptr, w_ptr, y_ptr, N, C, stride_x, stride_h, K: tl.constexpr, HAS_H: tl.constexpr,
                      BT: tl.constexpr, BC: tl.constexpr, INTERPRET: tl.constexpr):
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    c_ok = rc < C
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(K):
        src = rt + (j - (K - 1))  # the input row tap j reads; below 0: the history's column K-1+src
        xv = tl.load(x_ptr + src[:, None] * stride_x + rc[None, :], mask=(src >= 0)[:, None] & (src < N)[:, None]
                     & c_ok[None, :], other=0.0).to(tl.float32)
        if HAS_H:
            hv = tl.load(h_ptr + rc[None, :] * stride_h + (src + (K - 1))[:, None],
                         mask=(src < 0)[:, None] & (src + (K - 1) >= 0)[:, None] & c_ok[None, :], other=0.0)
            xv += hv.to(tl.float32)
        w = tl.load(w_ptr + rc * K + j, mask=c_ok, other=0.0).to(tl.float32)
        acc += xv * w[None, :]
    y = round_bf16(acc) if INTERPRET else acc.to(tl.bfloat16).to(tl.float32)
    y = y / (1.0 + tl.exp(-y))
    if INTERPRET:  # its own cast truncates (rounding.py): round first, the store's cast is then exact
        y = round_bf16(y)
    tl.store(y_ptr + rt[:, None] * C + rc[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(rt < N)[:, None] & c_ok[None, :])


def conv_silu(x: torch.Tensor, history: torch.Tensor | None, weight: torch.Tensor, block_t: int = 32,
              block_c: int = 128, out: torch.Tensor | None = None) -> torch.Tensor:
    """x bf16 [n, C] (rows contiguous, any row stride), history [C, K-1] (the slot's conv state; None:
    zeros), weight [C, K] -> silu(causal depthwise conv) bf16 [n, C], contiguous (`out`'s rows when
    given: a pass's chunks written side by side)."""
    n, c = x.shape
    k = weight.shape[-1]
    if x.stride(-1) != 1 or weight.shape[0] != c or (history is not None and history.shape != (c, k - 1)):
        raise ValueError(f"conv_silu: x {tuple(x.shape)} (stride {x.stride()}), weight {tuple(weight.shape)}, history "
                         f"{None if history is None else tuple(history.shape)} do not fit [n, C], [C, K], [C, K-1]")
    weight = weight.contiguous()
    h = weight if history is None else history.contiguous()  # any pointer when there is none: never read
    y = torch.empty(n, c, dtype=x.dtype, device=x.device) if out is None else out
    if y.shape != (n, c) or not y.is_contiguous():
        raise ValueError(f"conv_silu: out {tuple(y.shape)} must be a contiguous [{n}, {c}]")
    grid = (triton.cdiv(n, block_t), triton.cdiv(c, block_c))
    _conv_silu_kernel[grid](x, h, weight, y, n, c, x.stride(0), h.stride(0), K=k, HAS_H=history is not None,
                            BT=block_t, BC=block_c, INTERPRET=interpreted(), num_warps=4)
    return y
