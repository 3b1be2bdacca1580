"""NVFP4 W4A16 weight-streaming GEMV for decode on Hopper (no FP4 tensor cores): the packed
E2M1 weights and their E4M3 block scales are read once and dequantized in registers to
exactly the BF16 values the simulation and compressed-tensors' decompression give, then
multiplied with the BF16 activations on the tensor cores (M padded to 16).

Layouts as export writes them (compressed-tensors `nvfp4-pack-quantized`): weight_packed
uint8 [N, K/2] (even k in the low nibble), weight_scale E4M3 [N, K/16], weight_global_scale
fp32 [1]; dequantized w = e2m1 · (scale / global).

Decoding a nibble costs a few integer ops per weight, so it is done the cheap way: the three
magnitude bits placed at bit 9 of an fp16 (exponent field = E2M1 exponent, top mantissa bit
= E2M1 mantissa) are the E2M1 value times 2⁻¹⁴ — subnormal for 0 and ±0.5, exactly as E2M1
itself — and the 2¹⁴ goes into the block scale (a power of two, so rounding is unchanged).

Triton's interpreter (CI) computes tl.dot wrongly on BF16 values converted inside the kernel
(a 16×16 product came out ~1e10), and its fp32 -> bf16 conversion truncates. Under
TRITON_INTERPRET=1 the weights are therefore rounded with rounding.round_bf16 and multiplied
in fp32 — the same values as the GPU's bf16 path, which bench_kernels.py checks at real shapes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .rounding import e4m3_value, round_bf16
from .splitk import launch_plan, store_or_reduce


@triton.jit
def _e2m1_times_2m14(nib):
    """int16 nibbles -> fp16 values = E2M1(nib) * 2**-14 (sign in bit 3)."""
    bits = ((nib & 7) << 9) | ((nib & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _gemv_nvfp4_kernel(x_ptr, w_ptr, sc_ptr, sc8_ptr, gs_ptr, y_ptr, ws_ptr, tick_ptr, M, N, K, stride_xm, stride_wn,
                       stride_sn, stride_ym, K_PER_SPLIT, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       SPLIT_K: tl.constexpr, INTERPRET: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rkh = tl.arange(0, BK // 2)      # packed bytes of a K-tile
    rks = tl.arange(0, BK // 16)     # block scales of a K-tile
    rk = tl.arange(0, BK)
    inv_gs = 16384.0 / tl.load(gs_ptr)  # 2**14 / global: see the module docstring
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    nmask = rn < N
    for k0 in range(k_start, k_start + K_PER_SPLIT, BK):
        kh = k0 // 2 + rkh
        p = tl.load(w_ptr + rn[:, None] * stride_wn + kh[None, :], mask=nmask[:, None] & (kh[None, :] < K // 2),
                    other=0, eviction_policy="evict_first").to(tl.int16)
        ksb = k0 // 16 + rks
        s_off = rn[:, None] * stride_sn + ksb[None, :]
        s_mask = nmask[:, None] & (ksb[None, :] < K // 16)
        if INTERPRET:  # integer decode: the interpreter's E4M3 conversion is unreliable (rounding.py)
            s = e4m3_value(tl.load(sc_ptr + s_off, mask=s_mask, other=0).to(tl.int32))
        else:
            s = tl.load(sc8_ptr + s_off, mask=s_mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        lo = _e2m1_times_2m14(p & 15)
        hi = _e2m1_times_2m14((p >> 4) & 15)
        w = tl.reshape(tl.join(lo, hi), (BN, BK // 16, 16)).to(tl.float32)
        w = tl.reshape(w * (s * inv_gs)[:, :, None], (BN, BK))
        ks = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=(rm[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        if INTERPRET:  # the interpreter mis-multiplies bf16 made in-kernel (see module docstring)
            acc = tl.dot(x.to(tl.float32), tl.trans(round_bf16(w)), acc)
        else:
            acc = tl.dot(x, tl.trans(w.to(tl.bfloat16)), acc)
    store_or_reduce(acc, y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, M, N, stride_ym, BM, BN, SPLIT_K)


@triton.jit
def _e2m1_pair(t):
    """int32 words holding E2M1 nibbles at bits 0-3 and 16-19 -> their two fp32 values × 2**-14.
    One 32-bit AND/shift sequence decodes both halves (the fp16 bit trick above, twice)."""
    bits = ((t & 0x00070007) << 9) | ((t & 0x00080008) << 12)
    lo = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


# The same decode of a whole word in PTX: four shift/mask sequences put nibble pairs (i, i+4)
# in the two fp16 halves of a register, and each half converts to fp32 in one instruction
# (Triton's version above spends a truncation and a shift per half). GPU only.
_DECODE_WORD_PTX = tl.constexpr("""{
.reg .b32 t<4>, u<3>;
.reg .b16 h<8>;
shl.b32 t0, $8, 9;  and.b32 t0, t0, 0x0E000E00; shl.b32 u0, $8, 12; and.b32 u0, u0, 0x80008000; or.b32 t0, t0, u0;
shl.b32 t1, $8, 5;  and.b32 t1, t1, 0x0E000E00; shl.b32 u1, $8, 8;  and.b32 u1, u1, 0x80008000; or.b32 t1, t1, u1;
shl.b32 t2, $8, 1;  and.b32 t2, t2, 0x0E000E00; shl.b32 u2, $8, 4;  and.b32 u2, u2, 0x80008000; or.b32 t2, t2, u2;
shr.b32 t3, $8, 3;  and.b32 t3, t3, 0x0E000E00; and.b32 u0, $8, 0x80008000; or.b32 t3, t3, u0;
mov.b32 {h0, h4}, t0; mov.b32 {h1, h5}, t1; mov.b32 {h2, h6}, t2; mov.b32 {h3, h7}, t3;
cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1; cvt.f32.f16 $2, h2; cvt.f32.f16 $3, h3;
cvt.f32.f16 $4, h4; cvt.f32.f16 $5, h5; cvt.f32.f16 $6, h6; cvt.f32.f16 $7, h7;
}""")


@triton.jit
def _decode_word(v, ASM: tl.constexpr):
    """int32 words (8 nibbles, k = 0..7 from the low bits) -> 8 fp32 tensors, E2M1 × 2**-14."""
    if ASM:
        return tl.inline_asm_elementwise(_DECODE_WORD_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [v],
                                         dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    w0, w4 = _e2m1_pair(v)
    w1, w5 = _e2m1_pair(v >> 4)
    w2, w6 = _e2m1_pair(v >> 8)
    w3, w7 = _e2m1_pair(v >> 12)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _gemv_nvfp4_m1_kernel(x_ptr, w_ptr, sc_ptr, sc8_ptr, gs_ptr, y_ptr, ws_ptr, tick_ptr, N, K_WORDS, stride_wn,
                          stride_sn, WORDS_PER_SPLIT, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                          INTERPRET: tl.constexpr, PTX: tl.constexpr):
    """M = 1 without tensor cores: padding one row to the 16 an MMA needs wastes 15/16 of it
    and forces the decoded weights through a shared-memory layout change. Here the weights are
    read as 32-bit words (8 nibbles, k = 8j … 8j+7; 16-byte loads along the row) and decoded two
    nibbles per integer op (_e2m1_pair, or the PTX sequence when PTX); the products are summed
    per word in registers, the word's block scale multiplies that sum, not each weight, and the
    global scale multiplies the row's total once. It still reaches only 18–35 % of the copy
    bandwidth on an H200 (BENCHMARKS.md): the instructions per weight (decode, fp16 -> fp32,
    FMA, the activation loads), not the memory system, bound it."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    NW: tl.constexpr = BK // 8                               # words per tile row
    rn = pid_n * BN + tl.arange(0, BN)
    rw = tl.arange(0, NW)
    nmask = rn < N
    acc = tl.zeros((BN, NW), dtype=tl.float32)
    # Counted in words, not weights, and no mask along K (the wrapper picks BK dividing K, the
    # loop stops at K): what Triton needs to see to make the loads 16 bytes wide.
    w_start = pid_k * WORDS_PER_SPLIT
    for w0 in range(w_start, tl.minimum(w_start + WORDS_PER_SPLIT, K_WORDS), NW):
        kw = w0 + rw                                         # word index along K
        v = tl.load(w_ptr + rn[:, None] * stride_wn + kw[None, :], mask=nmask[:, None], other=0,
                    eviction_policy="evict_first")
        ws = _decode_word(v, PTX)
        part = tl.zeros((BN, NW), dtype=tl.float32)
        for i in tl.static_range(8):
            part += ws[i] * tl.load(x_ptr + kw * 8 + i).to(tl.float32)[None, :]
        s_off = rn[:, None] * stride_sn + kw[None, :] // 2   # two words per 16-weight block
        if INTERPRET:  # integer decode: the interpreter's E4M3 conversion is unreliable (rounding.py)
            s = e4m3_value(tl.load(sc_ptr + s_off, mask=nmask[:, None], other=0).to(tl.int32))
        else:
            s = tl.load(sc8_ptr + s_off, mask=nmask[:, None], other=0.0).to(tl.float32)
        acc += part * s
    y = tl.sum(acc, 1) * (16384.0 / tl.load(gs_ptr))
    if INTERPRET and SPLIT_K == 1:  # the interpreter's bf16 store truncates (rounding.py)
        y = round_bf16(y)
    store_or_reduce(y[None, :], y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, 1, N, 0, 1, BN, SPLIT_K)


def gemv_nvfp4(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, w_global_scale: torch.Tensor,
               out: torch.Tensor | None = None, block_n: int = 16, block_k: int = 256,
               split_k: int | None = None, num_warps: int = 4, num_stages: int = 4,
               path: str = "auto", ptx: bool = True) -> torch.Tensor:
    """x bf16 [M, K], w_packed uint8 [N, K/2], w_scale E4M3 [N, K/16], w_global_scale fp32 [1]
    -> bf16 [M, N]. path: "fma" (M = 1 only), "dot" (tensor cores), "auto" (fma at M = 1).
    ptx: the M = 1 path decodes words with the PTX sequence (GPU only; False: Triton's ops)."""
    m, k = x.shape
    n = w_packed.shape[0]
    if w_packed.shape[1] * 2 != k or w_scale.shape != (n, k // 16):
        raise ValueError(f"gemv_nvfp4: x has K={k} but the weight is packed {tuple(w_packed.shape)} "
                         f"with scales {tuple(w_scale.shape)}")
    if m > 64:
        raise ValueError(f"gemv_nvfp4 is for decode (M <= 64), got M={m}; dequantize and use a GEMM above that")
    if k % block_k:  # the M = 1 kernel reads whole tiles only (no mask along K)
        block_k = next(b for b in (64, 32, 16) if k % b == 0)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if path == "fma" or (path == "auto" and m == 1):
        if m != 1:
            raise ValueError(f"gemv_nvfp4: the fma path is for M = 1, got M={m}")
        _, grid, k_per, out, ws, tick = launch_plan(1, n, k, block_n, block_k, x.device, split_k, out)
        if w_packed.stride(0) % 4 or w_packed.stride(1) != 1 or w_packed.data_ptr() % 4:
            w_packed = w_packed.clone(memory_format=torch.contiguous_format)  # read as aligned int32 words
        _gemv_nvfp4_m1_kernel[grid](x, w_packed.view(torch.int32), w_scale.view(torch.uint8), w_scale,
                                    w_global_scale.reshape(1).float(), out, ws, tick, n, k // 8, w_packed.stride(0) // 4,
                                    w_scale.stride(0), k_per // 8, BN=block_n, BK=block_k, SPLIT_K=grid[1],
                                    num_warps=num_warps, num_stages=num_stages, INTERPRET=interp,
                                    PTX=ptx and not interp)
        return out
    bm, grid, k_per, out, ws, tick = launch_plan(m, n, k, block_n, block_k, x.device, split_k, out)
    _gemv_nvfp4_kernel[grid](x, w_packed, w_scale.view(torch.uint8), w_scale, w_global_scale.reshape(1).float(),
                                        out, ws, tick, m, n, k, x.stride(0), w_packed.stride(0), w_scale.stride(0), out.stride(0),
                                        k_per, BM=bm, BN=block_n, BK=block_k, SPLIT_K=grid[1], num_warps=num_warps,
                                        num_stages=num_stages, INTERPRET=interp)
    return out


def gemv_nvfp4_ref(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                   w_global_scale: torch.Tensor) -> torch.Tensor:
    """Plain torch, float64: x times the weight dequantized by quant.nvfp4 (the simulation's)."""
    from ...quant import nvfp4

    w = nvfp4.dequantize(w_packed, w_scale, w_global_scale, torch.bfloat16)
    return x.double() @ w.double().T
