"""The tensor-core weight-streaming GEMV for decode batches (M = 2…64), BF16 or FP8 W8A8:
y = x · Wᵀ (times x_scale[m] · w_scale[n] for FP8). M is padded to 16, the smallest MMA tile;
the weight stream is what costs, so tiles are 16 rows wide and K is split across CTAs
(splitk.py) to keep every SM reading. M = 1 runs on CUDA cores instead (gemv_m1.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .splitk import launch_plan, store_or_reduce


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
        if INTERPRET and not SCALED:  # the interpreter's bf16 tl.dot is only trusted in fp32 (gemv_nvfp4.py)
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if SCALED:
        xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
        wsc = tl.load(wsc_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc = acc * xs[:, None] * wsc[None, :]
    store_or_reduce(acc, y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, M, N, stride_ym, BM, BN, SPLIT_K)


def gemv_dot(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor | None = None,
             w_scale: torch.Tensor | None = None, out: torch.Tensor | None = None, block_n: int = 16,
             block_k: int = 256, split_k: int | None = None, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x [M, K], w [N, K]: both bf16, or both E4M3 with x_scale [M, 1] and w_scale [N, 1] ->
    bf16 [M, N]. Shapes are checked by the callers (gemv_bf16, gemv_fp8)."""
    m, k = x.shape
    n = w.shape[0]
    scaled = x_scale is not None
    bm, grid, k_per, out, ws, tick = launch_plan(m, n, k, block_n, block_k, x.device, split_k, out)
    _gemv_dot_kernel[grid](x, x_scale.reshape(-1).float() if scaled else x, w, w_scale.reshape(-1) if scaled else w,
                           out, ws, tick, m, n, k, x.stride(0), w.stride(0), out.stride(0), k_per, BM=bm, BN=block_n,
                           BK=block_k, SPLIT_K=grid[1], SCALED=scaled,
                           INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", num_warps=num_warps,
                           num_stages=num_stages)
    return out
