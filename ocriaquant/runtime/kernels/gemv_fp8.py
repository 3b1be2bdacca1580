"""FP8 W8A8 weight-streaming GEMV for decode (M = 1…64): y = (x_q · x_scale) @ (W_q · w_scale)ᵀ.

Layouts are the compressed-tensors FP8_DYNAMIC ones export writes: W_q E4M3 [N, K], w_scale
[N, 1] (per output channel); activations are E4M3 per token with an fp32 scale [M, 1]
(`quant_fp8_per_token`, or `silu_mul_quant` in the MLP). The dot runs on the FP8 tensor cores
with M padded to 16; the weight stream is what costs, so tiles are 16 rows wide and K is split
across CTAs (splitk.py) to keep all SMs reading.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import e4m3_bits, round_bf16
from .splitk import launch_plan, store_or_reduce

FP8_MAX = tl.constexpr(448.0)  # a constexpr: @jit code can read no other globals


@triton.jit
def _gemv_fp8_kernel(x_ptr, xs_ptr, w_ptr, wsc_ptr, y_ptr, ws_ptr, tick_ptr, M, N, K, stride_xm, stride_wn,
                     stride_ym, K_PER_SPLIT, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BK):
        ks = k0 + rk
        kmask = ks < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + ks[None, :], mask=(rn[:, None] < N) & kmask[None, :],
                    other=0.0, eviction_policy="evict_first")
        acc = tl.dot(x, tl.trans(w), acc)
    xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    wsc = tl.load(wsc_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    acc = acc * xs[:, None] * wsc[None, :]
    store_or_reduce(acc, y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, M, N, stride_ym, BM, BN, SPLIT_K)


def gemv_fp8(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
             out: torch.Tensor | None = None, block_n: int = 16, block_k: int = 256,
             split_k: int | None = None, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x_q E4M3 [M, K], x_scale fp32 [M, 1], w_q E4M3 [N, K], w_scale [N, 1] -> bf16 [M, N]."""
    m, k = x_q.shape
    n = w_q.shape[0]
    if w_q.shape[1] != k:
        raise ValueError(f"gemv_fp8: x has K={k} but the weight is {tuple(w_q.shape)}")
    if m > 64:
        raise ValueError(f"gemv_fp8 is for decode (M <= 64), got M={m}; use torch._scaled_mm above that")
    bm, grid, k_per, out, ws, tick = launch_plan(m, n, k, block_n, block_k, x_q.device, split_k, out)
    _gemv_fp8_kernel[grid](x_q, x_scale.reshape(-1).float(), w_q, w_scale.reshape(-1), out, ws, tick,
                                      m, n, k, x_q.stride(0), w_q.stride(0), out.stride(0), k_per,
                                      BM=bm, BN=block_n, BK=block_k, SPLIT_K=grid[1], num_warps=num_warps,
                                      num_stages=num_stages)
    return out


@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BK: tl.constexpr):
    row = tl.program_id(0)
    rk = tl.arange(0, BK)
    amax = tl.zeros((BK,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + row * stride_xm + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # compressed-tensors computes the scale in the activation dtype (bf16): round it there.
    scale = round_bf16(tl.math.div_rn(tl.max(amax, 0), FP8_MAX))  # IEEE division, as torch's
    scale = tl.where(scale == 0.0, 0.0078125, scale)  # bf16 eps, as compressed-tensors
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + row * stride_xm + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
        v = round_bf16(tl.math.div_rn(x, scale))
        v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * K + k0 + rk, e4m3_bits(v).to(tl.uint8), mask=k0 + rk < K)
    tl.store(s_ptr + row, scale)


def quant_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [M, K] -> (E4M3 [M, K], fp32 scale [M, 1]), numerics of quant.fp8.fake_quant_activation."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    _quant_fp8_kernel[(m,)](x, q.view(torch.uint8), s, k, x.stride(0), BK=min(4096, triton.next_power_of_2(k)), num_warps=8)
    return q, s


def gemv_fp8_ref(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Plain torch, float64: the exact product of the dequantized operands."""
    x = x_q.double() * x_scale.double()
    w = w_q.double() * w_scale.double()
    return x @ w.T
