"""The tensor-core weight-streaming GEMV for decode batches (M = 2…64), BF16 or FP8 W8A8:
y = x · Wᵀ (times x_scale[m] · w_scale[n] for FP8). M is padded to 16, the smallest MMA tile,
and K is split across CTAs (splitk.py) to keep every SM reading. M = 1 runs on CUDA cores
instead (gemv_m1.py).

Two forms. `swap` (what gemv_fp8 runs): the weight rows are the MMA's long side, yᵀ = W · xᵀ,
so a CTA streams a 64-row weight tile per K-step through a cp.async pipeline
into one Hopper wgmma (M = 64 per warpgroup) against the batch as its narrow side (N = 16…64),
whose few activation bytes every CTA reads again from L2. The plain form multiplies x [M, K] by
16-row weight tiles (M the MMA's long side, padded): every K-step a CTA moves as many
activation bytes as weight bytes and issues a 16-wide MMA, and it streams the weights well below
the swapped form's bandwidth. gemv_bf16 above batch 1 still takes the plain form (the runtime
runs cuBLAS there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .splitk import interpreted, launch_plan, store_or_reduce, use_pdl, wait_for_inputs


@triton.jit
def _dot(a, b, acc, SCALED: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a · bᵀ, a [R, BK] and b [C, BK] as loaded (rows K-contiguous)."""
    if INTERPRET and not SCALED:  # the interpreter's bf16 tl.dot is only trusted in fp32 (gemv_nvfp4.py)
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
    return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _scales(xs_ptr, wsc_ptr, rm, rn, M, N):
    """FP8's per-token and per-channel scales of a tile's batch rows rm and weight rows rn, fp32."""
    return (tl.load(xs_ptr + rm, mask=rm < M, other=0.0),
            tl.load(wsc_ptr + rn, mask=rn < N, other=0.0).to(tl.float32))


@triton.jit
def _gemv_dot_kernel(x_ptr, xs_ptr, w_ptr, wsc_ptr, y_ptr, ws_ptr, tick_ptr, M, N, K, stride_xm, stride_wn,
                     stride_ym, K_PER_SPLIT, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     SPLIT_K: tl.constexpr, SCALED: tl.constexpr, INTERPRET: tl.constexpr):
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
        acc = _dot(x, w, acc, SCALED, INTERPRET)
    if SCALED:
        xs, wsc = _scales(xs_ptr, wsc_ptr, rm, rn, M, N)
        acc = acc * xs[:, None] * wsc[None, :]
    store_or_reduce(acc, y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, M, N, stride_ym, BM, BN, SPLIT_K)


@triton.jit
def _gemv_swap_kernel(x_ptr, xs_ptr, w_ptr, wsc_ptr, y_ptr, ws_ptr, tick_ptr, M, N, K, stride_xm, stride_wn,
                      stride_ym, K_PER_SPLIT, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      SPLIT_K: tl.constexpr, SCALED: tl.constexpr, INTERPRET: tl.constexpr, EVEN_K: tl.constexpr,
                      EVEN_N: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr):
    """acc [BN, BM] = W[rows, k-range] · x[:, k-range]ᵀ: the weight tile is the MMA's A operand
    (K-major, as FP8 wgmma needs of both operands), the padded batch its N. EVEN_K / EVEN_N: no
    mask along K (K a multiple of BK) or along the weight rows."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    nmask = rn < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    # Both scales load before the loop (the weight rows' before the wait, the tokens' after it):
    # loaded after the loop they cost the tail a round trip.
    if SCALED:
        wsc = tl.load(wsc_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)  # the pipeline's prologue loads weights and x together: nothing of theirs before it
    if SCALED:
        xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    for k0 in tl.range(k_start, k_end, BK, num_stages=STAGES):
        ks = k0 + rk
        w_ptrs = w_ptr + rn[:, None] * stride_wn + ks[None, :]
        x_ptrs = x_ptr + rm[:, None] * stride_xm + ks[None, :]
        if EVEN_K and EVEN_N:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        elif EVEN_K:
            w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=nmask[:, None] & (ks < K)[None, :], other=0.0, eviction_policy="evict_first")
        if EVEN_K:
            x = tl.load(x_ptrs, mask=(rm < M)[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=(rm < M)[:, None] & (ks < K)[None, :], other=0.0)
        acc = _dot(w, x, acc, SCALED, INTERPRET)
    if SCALED:
        acc = acc * wsc[:, None] * xs[None, :]
    store_or_reduce(tl.trans(acc), y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, M, N, stride_ym, BM, BN, SPLIT_K)


def gemv_dot(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor | None = None,
             w_scale: torch.Tensor | None = None, out: torch.Tensor | None = None, block_n: int = 16,
             block_k: int = 256, split_k: int | None = None, num_warps: int = 4, num_stages: int = 4,
             swap: bool = False, pdl: bool | None = None) -> torch.Tensor:
    """x [M, K], w [N, K]: both bf16, or both E4M3 with x_scale [M, 1] and w_scale [N, 1] ->
    bf16 [M, N]. Shapes are checked by the callers (gemv_bf16, gemv_fp8). swap: the weight rows
    as the MMA's long side (block_n of them a CTA; see the module docstring), launched with PDL
    where splitk.use_pdl allows; the plain form launches without it."""
    m, k = x.shape
    n = w.shape[0]
    scaled = x_scale is not None
    bm, grid, k_per, out, ws, tick = launch_plan(m, n, k, block_n, block_k, x.device, split_k, out)
    if swap:
        pdl = use_pdl(x.device, pdl)
        _gemv_swap_kernel[grid](x, x_scale.reshape(-1).float() if scaled else x, w,
                                w_scale.reshape(-1) if scaled else w, out, ws, tick, m, n, k, x.stride(0),
                                w.stride(0), out.stride(0), k_per, BM=bm, BN=block_n, BK=block_k, SPLIT_K=grid[1],
                                SCALED=scaled, INTERPRET=interpreted(), EVEN_K=k % block_k == 0,
                                EVEN_N=n % block_n == 0, STAGES=num_stages, num_warps=num_warps, PDL=pdl,
                                launch_pdl=pdl)
        return out
    _gemv_dot_kernel[grid](x, x_scale.reshape(-1).float() if scaled else x, w, w_scale.reshape(-1) if scaled else w,
                           out, ws, tick, m, n, k, x.stride(0), w.stride(0), out.stride(0), k_per, BM=bm, BN=block_n,
                           BK=block_k, SPLIT_K=grid[1], SCALED=scaled, INTERPRET=interpreted(), num_warps=num_warps,
                           num_stages=num_stages)
    return out
