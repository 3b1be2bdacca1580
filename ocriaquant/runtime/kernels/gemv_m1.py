"""The M = 1 weight-streaming GEMV on CUDA cores, for BF16 and FP8 weights: y = x · Wᵀ
(times x_scale · w_scale[n] for FP8 W8A8).

At batch 1 a tensor-core tile pads the single row to 16 and sends the weights through a
shared-memory layout change; cuBLAS reaches 40–55 % of the copy bandwidth on the 4B's
2560-wide shapes. Here each thread reads contiguous 16-byte runs of a weight row (through a
cp.async pipeline, M1_STAGES) and multiplies them with the broadcast activations in fp32; the
row sums are reduced once at the end. K is split across CTAs (splitk.py) so a 2560-row output still fills
every SM. The products are exact in fp32 (BF16·BF16 and E4M3·E4M3 both are), so the result
is the tensor-core path's up to fp32 summation order.

With `silu` a BF16 fused gate_up streams a tile of gate rows and the same rows of up together and
writes silu(gate) · up, bf16-rounded as silu_mul_quant would from the two bf16 outputs: where the
down_proj is BF16 too, the batch-1 MLP is two launches, not three.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import e4m3_value, round_bf16
from .silu_mul_quant import silu_mul_values
from .splitk import interpreted, launch_plan, split_tile, store_row, use_pdl, wait_for_inputs


# The K loop's cp.async pipeline depth (two tiles in flight, in shared memory): faster than the
# hand-written register prefetch it replaced, and than 4 stages. The loop sets its own depth
# (tl.range): a kernel-level num_stages does not pipeline loads that feed no tl.dot.
M1_STAGES = 3


@triton.jit
def _load_w(w_ptr, w8_ptr, rn, nmask, stride_wn, k0, k_end, BK: tl.constexpr, FP8: tl.constexpr,
            INTERPRET: tl.constexpr):
    """Columns k0 … k0+BK-1 (< k_end) of rows rn, as stored (E4M3 codes under the interpreter)."""
    ks = k0 + tl.arange(0, BK)
    w_off = rn[:, None] * stride_wn + ks[None, :]
    wmask = nmask[:, None] & (ks < k_end)[None, :]
    if FP8 and INTERPRET:
        return tl.load(w8_ptr + w_off, mask=wmask, other=0).to(tl.int32)
    return tl.load(w_ptr + w_off, mask=wmask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _x_at(x_ptr, x8_ptr, ks, kmask, FP8: tl.constexpr, INTERPRET: tl.constexpr):
    """Activations ks as fp32 [BK]: once a K-step, whatever number of weight tiles they multiply."""
    if FP8 and INTERPRET:  # the interpreter's E4M3 conversion is unreliable (rounding.py)
        return e4m3_value(tl.load(x8_ptr + ks, mask=kmask, other=0).to(tl.int32))
    return tl.load(x_ptr + ks, mask=kmask, other=0.0).to(tl.float32)


@triton.jit
def _w_f32(w, FP8: tl.constexpr, INTERPRET: tl.constexpr):
    """A weight tile as _load_w returns it, in fp32."""
    if FP8 and INTERPRET:
        return e4m3_value(w)
    return w.to(tl.float32)


@triton.jit
def _gemv_m1_kernel(x_ptr, x8_ptr, xs_ptr, w_ptr, w8_ptr, wsc_ptr, y_ptr, ws_ptr, tick_ptr, N, K, stride_wn,
                    K_PER_SPLIT, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr, FP8: tl.constexpr,
                    SILU: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr):
    """SILU (BF16, no split): w is a fused [gate; up] of 2·N rows; the CTA streams gate rows rn
    and up rows N + rn together and writes silu(gate) · up [N]."""
    pid_n, pid_k, rn, nmask, k_start, k_end = split_tile(N, K, K_PER_SPLIT, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    if SILU:
        acc_u = tl.zeros((BN, BK), dtype=tl.float32)
    wait_for_inputs(PDL)
    # Triton pipelines this loop's loads through shared memory (cp.async, STAGES - 1 tiles ahead)
    for k0 in tl.range(k_start, k_end, BK, num_stages=STAGES):
        w = _load_w(w_ptr, w8_ptr, rn, nmask, stride_wn, k0, k_end, BK, FP8, INTERPRET)
        ks = k0 + rk
        x = _x_at(x_ptr, x8_ptr, ks, ks < k_end, FP8, INTERPRET)
        acc += _w_f32(w, FP8, INTERPRET) * x[None, :]
        if SILU:
            w_u = _load_w(w_ptr, w8_ptr, rn + N, nmask, stride_wn, k0, k_end, BK, FP8, INTERPRET)
            acc_u += _w_f32(w_u, FP8, INTERPRET) * x[None, :]
    y = tl.sum(acc, 1)
    if FP8:
        y = y * tl.load(xs_ptr) * tl.load(wsc_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    if SILU:  # what gemv_m1 then silu_mul_quant(..., "bf16") compute: both outputs rounded to bf16 first
        h = silu_mul_values(round_bf16(y), round_bf16(tl.sum(acc_u, 1)))
        tl.store(y_ptr + rn, h.to(y_ptr.dtype.element_ty), mask=nmask)
    else:
        store_row(y, y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, N, BN, SPLIT_K, False, INTERPRET)


def gemv_m1(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor | None = None,
            w_scale: torch.Tensor | None = None, out: torch.Tensor | None = None, block_n: int = 16,
            block_k: int = 256, split_k: int | None = None, num_warps: int = 4, pdl: bool | None = None,
            silu: bool = False) -> torch.Tensor:
    """x [1, K], w [N, K], both bf16 or both E4M3 (then x_scale [1, 1] and w_scale [N, 1]
    fp32/bf16 are required) -> bf16 [1, N]. silu (bf16): w is a fused gate_up [2·I, K], the
    result silu(gate) · up [1, I] in one launch (K is not split)."""
    m, k = x.shape
    n = w.shape[0]
    if silu and (n % 2 or w.dtype != torch.bfloat16):
        raise ValueError(f"gemv_m1: silu takes a bf16 [gate; up] weight of even rows, got {tuple(w.shape)} {w.dtype}")
    n = n // 2 if silu else n
    if m != 1 or w.shape[1] != k or w.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv_m1: x must be [1, K] and w [N, K] with contiguous rows, got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    fp8 = w.dtype == torch.float8_e4m3fn
    if fp8 != (x.dtype == torch.float8_e4m3fn) or fp8 != (x_scale is not None and w_scale is not None):
        raise ValueError("gemv_m1: x and w are both bf16, or both E4M3 with x_scale and w_scale")
    _, grid, k_per, out, ws, tick = launch_plan(1, n, k, block_n, block_k, x.device, 1 if silu else split_k, out)
    pdl = use_pdl(x.device, pdl)
    as_bytes = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)  # noqa: E731
    _gemv_m1_kernel[grid](x, as_bytes(x), x_scale.reshape(-1).float() if fp8 else x,
                          w, as_bytes(w), w_scale.reshape(-1) if fp8 else w, out, ws, tick, n, k, w.stride(0), k_per,
                          BN=block_n, BK=block_k, SPLIT_K=grid[1], FP8=fp8, SILU=silu, INTERPRET=interpreted(),
                          num_warps=num_warps, STAGES=M1_STAGES, PDL=pdl, launch_pdl=pdl)
    return out
