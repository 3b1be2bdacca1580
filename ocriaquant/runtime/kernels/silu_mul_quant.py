"""Fused MLP activation for quantized down projections: silu(gate) · up, quantized in the same
pass, so the [M, intermediate] BF16 product never goes to memory and back.

- `fmt="fp8"` (h200 and b200 FP8 down_proj): E4M3 per token, scale = absmax / 448 — what
  gemv_fp8 consumes.
- `fmt="bf16"` (a W4A16 NVFP4 or BF16 down_proj on Hopper): the BF16 product only, one
  launch in place of torch's two.
- `fmt="nvfp4"` (b200 W4A4 emulation): E2M1 packed two per byte with one E4M3 scale per 16
  values under a static global scale — what a Blackwell NVFP4 GEMM consumes.

Rounding follows compressed-tensors on BF16 activations (quant/): the product is rounded to
BF16 as torch computes it, FP8 scales are computed in BF16, NVFP4 block scales as in
quant.nvfp4.block_scales. One program per token row; the row is walked in chunks (the FP8
absmax needs the whole row first, so FP8 walks it twice — the second time from L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .half2 import fp8_pairs, store_nvfp4_pairs
from .rounding import FP8_MAX, e4m3_bits, e4m3_value, fp8_token_codes, fp8_token_scale, round_bf16
from .splitk import start_after_producer, use_pdl


@triton.jit
def silu_mul_values(g, u):
    """silu(g) · u as torch computes it on BF16 tensors (F.silu rounded to bf16, the product
    rounded to bf16); fp32 in and out. Also gemv_nvfp4's fused gate_up epilogue."""
    s = round_bf16(g / (1.0 + tl.exp(-g)))
    return round_bf16(s * u)


@triton.jit
def _silu_mul(g_ptr, u_ptr, offs, mask):
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return silu_mul_values(g, u)


@triton.jit
def _silu_mul_fp8_kernel(g_ptr, u_ptr, q_ptr, s_ptr, p_ptr, I, stride_g, stride_u, BLOCK: tl.constexpr,
                         HALF: tl.constexpr, PDL: tl.constexpr):
    start_after_producer(PDL)  # the next GEMV streams weights; this waits for its own inputs
    row = tl.program_id(0)
    r = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, I, BLOCK):
        m = k0 + r < I
        h = _silu_mul(g_ptr + row * stride_g, u_ptr + row * stride_u, k0 + r, m)
        amax = tl.maximum(amax, tl.abs(h))
    scale = fp8_token_scale(tl.max(amax, 0))
    for k0 in range(0, I, BLOCK):
        m = k0 + r < I
        h = _silu_mul(g_ptr + row * stride_g, u_ptr + row * stride_u, k0 + r, m)
        codes = fp8_token_codes(h, scale)
        tl.store(q_ptr + row * I + k0 + r, codes.to(tl.uint8), mask=m)
        if HALF:  # the codes as gemv_fp8's batch-1 kernel reads them (half2.py)
            tl.store(p_ptr + row * I + k0 + r, fp8_pairs(codes), mask=m)
    tl.store(s_ptr + row, scale)


@triton.jit
def _silu_mul_bf16_kernel(g_ptr, u_ptr, h_ptr, xw_ptr, xs_ptr, I, stride_g, stride_u, BLOCK: tl.constexpr,
                          PAIRS: tl.constexpr, PDL: tl.constexpr):
    start_after_producer(PDL)  # the next GEMV streams weights; this waits for its own inputs
    row = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK
    r = k0 + tl.arange(0, BLOCK)
    m = r < I
    h = _silu_mul(g_ptr + row * stride_g, u_ptr + row * stride_u, r, m)
    tl.store(h_ptr + row * I + r, h.to(h_ptr.dtype.element_ty), mask=m)
    if PAIRS:  # the product as gemv_nvfp4's batch-1 kernel reads it (half2.py)
        store_nvfp4_pairs(h, xw_ptr + row * (I // 2), xs_ptr + row * (I // 16), k0, I)


@triton.jit
def _silu_mul_nvfp4_kernel(g_ptr, u_ptr, p_ptr, sc_ptr, gs_ptr, I, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    gs = tl.load(gs_ptr)
    r = tl.arange(0, BLOCK)
    for k0 in range(0, I, BLOCK):
        m = k0 + r < I
        h = tl.reshape(_silu_mul(g_ptr + row * stride_g, u_ptr + row * stride_u, k0 + r, m), (BLOCK // 16, 16))
        local = round_bf16(tl.math.div_rn(tl.max(tl.abs(h), 1), 6.0))
        sc_bits = e4m3_bits(tl.minimum(gs * local, FP8_MAX))
        sc = e4m3_value(sc_bits)
        sc_bits = tl.where(sc == 0.0, 0x20, sc_bits)  # 0.125, compressed-tensors' zero-scale eps
        sc = tl.where(sc == 0.0, 0.125, sc)
        v = tl.math.div_rn(h, tl.math.div_rn(sc, gs)[:, None])  # IEEE division, as torch's
        a = tl.abs(v)
        idx = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
               + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
               + (a > 5.0).to(tl.int32))
        nib = idx | ((v < 0).to(tl.int32) << 3)  # -0.0 packs as +0, as compressed-tensors' "+ 0.0"
        lo, hi = tl.split(tl.reshape(nib, (BLOCK // 2, 2)))
        rp = k0 // 2 + tl.arange(0, BLOCK // 2)
        tl.store(p_ptr + row * (I // 2) + rp, (lo | (hi << 4)).to(tl.uint8), mask=rp < I // 2)
        rs = k0 // 16 + tl.arange(0, BLOCK // 16)
        tl.store(sc_ptr + row * (I // 16) + rs, sc_bits.to(tl.uint8), mask=rs < I // 16)


def silu_mul_quant(gate: torch.Tensor, up: torch.Tensor, fmt: str = "fp8",
                   input_global_scale: torch.Tensor | None = None, block: int = 2048, half: bool = False,
                   pairs: bool = False, pdl: bool | None = None):
    """gate, up bf16 [M, I] (row stride free, e.g. halves of a fused gate_up output) ->
    fp8: (E4M3 [M, I], fp32 scale [M, 1]), with half also the codes' fp16 pairs [M, I] (gemv_fp8's
    batch-1 input); nvfp4: (uint8 [M, I/2], E4M3 scales [M, I/16]); bf16: the product [M, I],
    with pairs (h, (int32 [M, I/2], fp32 [M, I/16])), its NVFP4 activation pairs (gemv_nvfp4's
    batch-1 input, half2.py). pdl: as splitk.use_pdl (the nvfp4 form launches without)."""
    m, i = gate.shape
    if up.shape != gate.shape or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"silu_mul_quant: gate {tuple(gate.shape)} and up {tuple(up.shape)} must match, rows contiguous")
    block = min(block, triton.next_power_of_2(i))
    pdl = use_pdl(gate.device, pdl)
    if fmt == "fp8":
        q = torch.empty(m, i, dtype=torch.float8_e4m3fn, device=gate.device)
        s = torch.empty(m, 1, dtype=torch.float32, device=gate.device)
        p = torch.empty(m, i, dtype=torch.float16, device=gate.device) if half else s
        _silu_mul_fp8_kernel[(m,)](gate, up, q.view(torch.uint8), s, p, i, gate.stride(0), up.stride(0), BLOCK=block,
                                   HALF=half, num_warps=8, PDL=pdl, launch_pdl=pdl)
        return (q, s, p) if half else (q, s)
    if fmt == "bf16":
        if pairs and i % 16:
            raise ValueError(f"silu_mul_quant: NVFP4 activation pairs need I a multiple of 16, got {i}")
        h = torch.empty(m, i, dtype=torch.bfloat16, device=gate.device)
        xw = torch.empty(m, i // 2, dtype=torch.int32, device=gate.device) if pairs else h
        xs = torch.empty(m, i // 16, dtype=torch.float32, device=gate.device) if pairs else h
        _silu_mul_bf16_kernel[(m, triton.cdiv(i, block))](gate, up, h, xw, xs, i, gate.stride(0), up.stride(0),
                                                           BLOCK=block, PAIRS=pairs, num_warps=4,
                                                           PDL=pdl, launch_pdl=pdl)
        return (h, (xw, xs)) if pairs else h
    if fmt == "nvfp4":
        if input_global_scale is None or i % 16:
            raise ValueError("silu_mul_quant nvfp4 needs input_global_scale and I a multiple of 16")
        p = torch.empty(m, i // 2, dtype=torch.uint8, device=gate.device)
        sc = torch.empty(m, i // 16, dtype=torch.float8_e4m3fn, device=gate.device)
        _silu_mul_nvfp4_kernel[(m,)](gate, up, p, sc.view(torch.uint8), input_global_scale.reshape(1).float(), i, gate.stride(0),
                                     up.stride(0), BLOCK=block, num_warps=8)
        return p, sc
    raise ValueError(f"silu_mul_quant: unknown format {fmt!r}; fp8, nvfp4 or bf16")

