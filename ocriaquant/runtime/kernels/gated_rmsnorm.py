"""The GDN output's gated RMSNorm over prefill rows, in one launch: per token and value head,
o = (w · bf16(x / rms(x))) · silu(z), with transformers' roundings (Qwen3_5RMSNormGated: the norm
in fp32, the weight multiplied in bf16, the gate's SiLU in fp32, the product rounded once).
The torch ops are ~10 passes over the [n, HV·V] block; z is read where the fused input
projection wrote it (any row stride), where the torch path first copies it to [n·HV, V].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import round_bf16
from .splitk import interpreted


@triton.jit
def _gated_rmsnorm_kernel(x_ptr, z_ptr, w_ptr, o_ptr, R, HV, V, stride_z, eps, BR: tl.constexpr, BV: tl.constexpr,
                          INTERPRET: tl.constexpr):
    rr = tl.program_id(0) * BR + tl.arange(0, BR)  # rows: token · HV + head
    rv = tl.arange(0, BV)
    m = (rr < R)[:, None] & (rv < V)[None, :]
    x = tl.load(x_ptr + rr[:, None] * V + rv[None, :], mask=m, other=0.0).to(tl.float32)
    z_off = (rr // HV)[:, None] * stride_z + (rr % HV)[:, None] * V + rv[None, :]
    z = tl.load(z_ptr + z_off, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + rv, mask=rv < V, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / V + eps)
    h = round_bf16(x * rstd[:, None]) if INTERPRET else (x * rstd[:, None]).to(tl.bfloat16).to(tl.float32)
    h = round_bf16(w[None, :] * h) if INTERPRET else (w[None, :] * h).to(tl.bfloat16).to(tl.float32)
    o = h * (z / (1.0 + tl.exp(-z)))
    if INTERPRET:  # its own cast truncates (rounding.py): round first, the store's cast is then exact
        o = round_bf16(o)
    tl.store(o_ptr + rr[:, None] * V + rv[None, :], o.to(o_ptr.dtype.element_ty), mask=m)


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, block_r: int = 16) -> torch.Tensor:
    """x bf16 [n, HV, V] (contiguous), z bf16 [n, HV·V] (rows contiguous, any row stride: a view of the
    fused input projection's output), weight [V] -> o bf16 [n, HV·V], contiguous."""
    n, hv, v = x.shape
    if not x.is_contiguous() or z.shape != (n, hv * v) or z.stride(-1) != 1 or weight.shape != (v,):
        raise ValueError(f"gated_rmsnorm: x {tuple(x.shape)} must be contiguous [n, HV, V], z {tuple(z.shape)} "
                         f"[n, HV·V] with contiguous rows, weight {tuple(weight.shape)} [V]")
    o = torch.empty(n, hv * v, dtype=x.dtype, device=x.device)
    rows = n * hv
    _gated_rmsnorm_kernel[(triton.cdiv(rows, block_r),)](x, z, weight, o, rows, hv, v, z.stride(0), eps, BR=block_r,
                                                         BV=triton.next_power_of_2(v), INTERPRET=interpreted(),
                                                         num_warps=4)
    return o
