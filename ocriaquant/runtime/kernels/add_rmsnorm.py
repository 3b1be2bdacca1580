"""Residual add + Qwen3.5's RMSNorm in one pass: r = x + h (BF16, as the torch residual add
rounds it), y = r / rms(r) · (1 + w) in fp32, cast back.

In a decode step at batch 1 every op is tiny, so the step costs launches, not bytes: the torch
norm is ~7 kernels (cast, square, mean, rsqrt, two multiplies, cast) plus the add, twice per
layer. This is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .half2 import fp8_pairs, store_nvfp4_pairs
from .partials import Partials
from .rounding import fp8_token_codes, fp8_token_scale, round_bf16
from .splitk import interpreted, start_after_producer, use_pdl


NORM_SLICE_B1 = 512  # columns per program at batch 1 (add_rmsnorm's slice_d)
# Warps per slice program: each program reads its whole row (and a GEMV's split-K partials) for the
# statistics, so its threads' chains are long; more warps shorten them (16 measured faster than 4 or 8).
NORM_WARPS_B1 = 16


@triton.jit
def _residual(x_ptr, h_ptr, stride_hp, rd, m, HAS_H: tl.constexpr, PARTS: tl.constexpr, INTERPRET: tl.constexpr):
    """r = x + h at columns rd, rounded to bf16 as torch's bf16 add rounds it (the interpreter's
    own cast truncates, see rounding.py), in fp32; x alone without h. PARTS > 0: h is a GEMV's
    unreduced split-K output (partials.Partials), PARTS fp32 rows stride_hp apart, summed in split
    order and rounded to bf16 as store_or_reduce would have stored it."""
    r = tl.load(x_ptr + rd, mask=m, other=0.0).to(tl.float32)
    if HAS_H:
        if PARTS > 0:
            h = tl.load(h_ptr + rd, mask=m, other=0.0)
            for p in tl.static_range(1, PARTS):
                h += tl.load(h_ptr + p * stride_hp + rd, mask=m, other=0.0)
            h = round_bf16(h)
        else:
            h = tl.load(h_ptr + rd, mask=m, other=0.0).to(tl.float32)
        r = r + h
        r = round_bf16(r) if INTERPRET else r.to(tl.bfloat16).to(tl.float32)
    return r


@triton.jit
def _normed(r, rstd, w):
    """The bf16 norm output (kept in fp32), which the quantized forms are made from; w: the norm
    weight at r's columns, in fp32."""
    return round_bf16(r * rstd * (1.0 + w))


@triton.jit
def _add_rmsnorm_kernel(x_ptr, h_ptr, w_ptr, r_ptr, y_ptr, q_ptr, s_ptr, p_ptr, D, eps, stride_x, stride_h, stride_hp,
                        stride_r, stride_y, HAS_H: tl.constexpr, PARTS: tl.constexpr, QUANT: tl.constexpr,
                        BD: tl.constexpr, BS: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    """Program (row, slice): the row's statistics from the whole row (its sum of squares and,
    for FP8, its absmax), then r, y and y's quantized form for the slice's BS columns only.
    QUANT: 0 none; 1 FP8 codes (q) and scale (s); 2 those and their fp16 pairs (p); 3 NVFP4
    activation pairs, words in q and block scales in s (half2.py)."""
    row = tl.program_id(0)
    start = tl.program_id(1) * BS
    x_row, h_row = x_ptr + row * stride_x, h_ptr + row * stride_h
    rd = tl.arange(0, BD)
    m = rd < D
    rs = start + tl.arange(0, BS)
    ms = rs < D
    STATS_W: tl.constexpr = BS != BD and (QUANT == 1 or QUANT == 2)  # the whole row's y, for the absmax
    # The norm weight is constant, so it loads before the wait, under the producer's tail; the
    # slice's own x and h load in the same round trip as the whole row's, not after the reductions.
    w_s = tl.load(w_ptr + rs, mask=ms, other=0.0).to(tl.float32)
    if STATS_W:
        w_d = tl.load(w_ptr + rd, mask=m, other=0.0).to(tl.float32)
    start_after_producer(PDL)  # the next GEMV streams weights; this waits for its own inputs
    r = _residual(x_row, h_row, stride_hp, rd, m, HAS_H, PARTS, INTERPRET)
    if BS != BD:
        r_s = _residual(x_row, h_row, stride_hp, rs, ms, HAS_H, PARTS, INTERPRET)
    rstd = tl.rsqrt(tl.sum(r * r, 0) / D + eps)
    if BS == BD:  # one program per row: the slice is the row, already in registers
        y = _normed(r, rstd, w_s)
        if QUANT == 1 or QUANT == 2:
            scale = fp8_token_scale(tl.max(tl.abs(y), 0))
    else:
        if STATS_W:  # quant_fp8_per_token's scale needs the whole row's output
            scale = fp8_token_scale(tl.max(tl.abs(_normed(r, rstd, w_d)), 0))
        r = r_s
        y = _normed(r, rstd, w_s)
    if HAS_H:
        tl.store(r_ptr + row * stride_r + rs, r.to(r_ptr.dtype.element_ty), mask=ms)
    tl.store(y_ptr + row * stride_y + rs, y.to(y_ptr.dtype.element_ty), mask=ms)
    if QUANT == 1 or QUANT == 2:  # quant_fp8_per_token's numerics (gemv_fp8.py)
        codes = fp8_token_codes(y, scale)
        tl.store(q_ptr + row * D + rs, codes.to(tl.uint8), mask=ms)
        if tl.program_id(1) == 0:
            tl.store(s_ptr + row, scale)
        if QUANT == 2:
            tl.store(p_ptr + row * D + rs, fp8_pairs(codes), mask=ms)
    if QUANT == 3:
        store_nvfp4_pairs(y, q_ptr + row * (D // 2), s_ptr + row * (D // 16), start, D)


def add_rmsnorm(x: torch.Tensor, h: torch.Tensor | Partials | None, weight: torch.Tensor, eps: float,
                quant: str | None = None, slice_d: int | None = None, pdl: bool | None = None):
    """x, h bf16 [B, D] (h None: norm only; or partials.Partials [S, B, D], a GEMV's split-K output
    still unreduced, added up here), weight [D] -> (r = x + h, y = rmsnorm(r)). With h
    None r is x itself. y is also written in the form the next GEMV reads, as a third item:
    - quant="fp8": (E4M3 [B, D], fp32 scale [B, 1]) — quant_fp8_per_token(y) without its launch
      — and at B = 1 the codes' fp16 pairs [1, D] for gemv_fp8's batch-1 kernel;
    - quant="nvfp4": at B = 1, (int32 [1, D/2], fp32 [1, D/16]), y's pairs for gemv_nvfp4's
      batch-1 kernel (nvfp4_x_pairs); above B = 1 nothing (the W4A16 Linears take y itself).
    slice_d: columns a program writes (a power of two, at least 16; D or more: the whole row, one
    program per row, 8 warps past 2048 columns). With slices every program reads its row whole
    for the statistics and shares out the per-element work (rounding, codes, pairs, stores).
    None: 512-column slices at B = 1, the whole row above. At batch 1 the one-program norm sat on
    the decode step's critical path 65 times a step; above it B programs already fill the GPU's
    schedulers, and slices cost time, so only batch 1 slices. pdl: as splitk.use_pdl."""
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        raise ValueError(f"add_rmsnorm: x must be bf16 with contiguous rows, got {x.dtype} {tuple(x.stride())}")
    if quant not in (None, "fp8", "nvfp4"):
        raise ValueError(f"add_rmsnorm: quant must be None, 'fp8' or 'nvfp4', got {quant!r}")
    b, d = x.shape
    y = torch.empty_like(x)
    r = torch.empty_like(x) if h is not None else x
    parts = 0
    if isinstance(h, Partials):
        hh = h.parts
        parts = hh.shape[0]
        if hh.dtype != torch.float32 or hh.shape[1:] != x.shape or not hh.is_contiguous():
            raise ValueError(f"add_rmsnorm: partials must be contiguous fp32 [S, {b}, {d}], got {hh.dtype} "
                             f"{tuple(hh.shape)}")
    else:
        hh = h if h is not None else x
    hp_stride = hh.stride(0) if parts else 0
    h_stride = hh.stride(1) if parts else hh.stride(0)
    code, extra = 0, None
    q = s = p = y
    if quant == "fp8":
        q = torch.empty(b, d, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(b, 1, dtype=torch.float32, device=x.device)
        code, extra = 1, (q, s)
        if b == 1:
            p = torch.empty(b, d, dtype=torch.float16, device=x.device)
            code, extra = 2, (q, s, p)
        q = q.view(torch.uint8)
    elif quant == "nvfp4" and b == 1 and d % 16 == 0:
        q = torch.empty(b, d // 2, dtype=torch.int32, device=x.device)
        s = torch.empty(b, d // 16, dtype=torch.float32, device=x.device)
        code, extra = 3, (q, s)
    pdl = use_pdl(x.device, pdl)
    bd = triton.next_power_of_2(d)
    if slice_d is None:
        slice_d = NORM_SLICE_B1 if b == 1 else bd
    bs = max(16, min(triton.next_power_of_2(slice_d), bd))
    _add_rmsnorm_kernel[(b, triton.cdiv(d, bs))](x, hh, weight, r, y, q, s, p, d, eps, x.stride(0), h_stride,
                                                 hp_stride, r.stride(0), y.stride(0), HAS_H=h is not None,
                                                 PARTS=parts, QUANT=code, BD=bd, BS=bs,
                                                 INTERPRET=interpreted(),
                                                 num_warps=(8 if d > 2048 else 4) if bs == bd else NORM_WARPS_B1,
                                                 PDL=pdl, launch_pdl=pdl)
    return (r, y) if extra is None else (r, y, extra)

