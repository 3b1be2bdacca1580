"""Paired fp16 arithmetic for the batch-1 GEMVs of quantized weights (gemv_nvfp4, gemv_fp8).

At M = 1 every weight streams once and costs instructions of its own. Decoding it to fp32 and
multiplying there took, per weight, a conversion (a quarter-rate instruction on Hopper), an
FFMA and an activation load or conversion: gemv_nvfp4 reached 18–35 % of the copy bandwidth
and gemv_fp8 41–61 % (BENCHMARKS.md, session 4), bound by those instructions, not by memory.
Here two weights are decoded into the two halves of one register and multiplied by two
activations with one `fma.rn.f16x2`; a block's products are summed in fp16 and only the block
sum is converted to fp32, where the block scale multiplies it.

The activations are made ready once per CTA and K-tile, not per weight: scaled by a power of
two or by 2^15 / max|x| so that no fp16 product or block sum can overflow, rounded to fp16
(11 significant bits; BF16 has 8, so x loses nothing but values under 2^-24 of the largest),
and packed two to a 32-bit word in the order the weight decoder produces its halves.

Under TRITON_INTERPRET=1 (CI) inline PTX cannot run; the same sums are then taken in fp32 from
the same fp16 values (`_*_ref`), which agrees with the GPU's fp16 block sums to fp16
rounding — what the kernel tests bound against the float64 reference.
"""

import triton
import triton.language as tl

from .rounding import e4m3_value


@triton.jit
def pack_f16x2(lo, hi):
    """Two fp32 tensors (values fp16 can hold) -> int32 words holding fp16(lo) | fp16(hi) << 16."""
    lo_bits = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_bits = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo_bits | (hi_bits << 16)


@triton.jit
def e2m1_times_2m14(nib):
    """Integer nibbles -> fp16 values E2M1(nib) × 2^-14: the three magnitude bits placed at bit 9
    of an fp16 (exponent field = E2M1 exponent, top mantissa bit = E2M1 mantissa) are the E2M1
    value times 2^-14 — subnormal for 0 and ±0.5, exactly as E2M1 itself; the sign (bit 3) goes
    to bit 15."""
    bits = ((nib & 7) << 9) | ((nib & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _e2m1_pair(t):
    """int32 words holding nibbles at bits 0-3 and 16-19 -> their two values × 2^-14, fp32."""
    return e2m1_times_2m14(t & 15).to(tl.float32), e2m1_times_2m14((t >> 16) & 15).to(tl.float32)


# One NVFP4 block (16 weights = two 32-bit words, $1 and $2; k = 0..7 from the low nibble of
# $1) times its activations ($3..$10: per word, the fp16 pairs (x[i], x[i+4]) for i = 0..3).
# Nibble pair (i, i+4) of a word sits at bits 4i and 4i+16: one shift puts its magnitudes at
# bits 9-11 and 25-27, another its signs at 15 and 31 (e2m1_times_2m14's decode, on both halves
# at once); ptxas folds each and/or pair into one LOP3. Out: the block's sum × 2^-14, fp32.
_NVFP4_BLOCK_PTX = tl.constexpr("""{
.reg .b32 a, b, p, acc;
.reg .b16 l, h;
.reg .f32 fl, fh;
shr.b32 a, $1, 3; and.b32 a, a, 0x0E000E00; and.b32 b, $1, 0x80008000; or.b32 p, a, b; mul.rn.f16x2 acc, p, $6;
shl.b32 a, $1, 1; and.b32 a, a, 0x0E000E00; shl.b32 b, $1, 4; and.b32 b, b, 0x80008000; or.b32 p, a, b; fma.rn.f16x2 acc, p, $5, acc;
shl.b32 a, $1, 5; and.b32 a, a, 0x0E000E00; shl.b32 b, $1, 8; and.b32 b, b, 0x80008000; or.b32 p, a, b; fma.rn.f16x2 acc, p, $4, acc;
shl.b32 a, $1, 9; and.b32 a, a, 0x0E000E00; shl.b32 b, $1, 12; and.b32 b, b, 0x80008000; or.b32 p, a, b; fma.rn.f16x2 acc, p, $3, acc;
shr.b32 a, $2, 3; and.b32 a, a, 0x0E000E00; and.b32 b, $2, 0x80008000; or.b32 p, a, b; fma.rn.f16x2 acc, p, $10, acc;
shl.b32 a, $2, 1; and.b32 a, a, 0x0E000E00; shl.b32 b, $2, 4; and.b32 b, b, 0x80008000; or.b32 p, a, b; fma.rn.f16x2 acc, p, $9, acc;
shl.b32 a, $2, 5; and.b32 a, a, 0x0E000E00; shl.b32 b, $2, 8; and.b32 b, b, 0x80008000; or.b32 p, a, b; fma.rn.f16x2 acc, p, $8, acc;
shl.b32 a, $2, 9; and.b32 a, a, 0x0E000E00; shl.b32 b, $2, 12; and.b32 b, b, 0x80008000; or.b32 p, a, b; fma.rn.f16x2 acc, p, $7, acc;
mov.b32 {l, h}, acc;
cvt.f32.f16 fl, l; cvt.f32.f16 fh, h; add.f32 $0, fl, fh;
}""")


@triton.jit
def _nvfp4_block_ptx(v0, v1, x0, x1, x2, x3, x4, x5, x6, x7):
    """Σ E2M1(w) · x × 2^-14 over one block per element: v0, v1 its two words, x0..x7 the packed
    activation pairs (pack_f16x2; x0..x3 for v0, x4..x7 for v1). GPU only."""
    return tl.inline_asm_elementwise(_NVFP4_BLOCK_PTX, "=r,r,r,r,r,r,r,r,r,r,r",
                                     [v0, v1, x0, x1, x2, x3, x4, x5, x6, x7], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _nvfp4_word_ref(v, xa, xb, xc, xd, xe, xf, xg, xh):
    """Σ over one word's 8 weights of E2M1 × 2^-14 × x, in fp32, x* the word's 8 activations."""
    w0, w4 = _e2m1_pair(v)
    w1, w5 = _e2m1_pair(v >> 4)
    w2, w6 = _e2m1_pair(v >> 8)
    w3, w7 = _e2m1_pair(v >> 12)
    return w0 * xa + w1 * xb + w2 * xc + w3 * xd + w4 * xe + w5 * xf + w6 * xg + w7 * xh


@triton.jit
def _nvfp4_block_ref(v0, v1, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """_nvfp4_block_ptx in fp32 Triton ops (any backend), from the 16 unpacked fp16 activations."""
    return (_nvfp4_word_ref(v0, x0, x1, x2, x3, x4, x5, x6, x7)
            + _nvfp4_word_ref(v1, x8, x9, x10, x11, x12, x13, x14, x15))


# Four FP8 words (16 E4M3 weights, k = 0..15 from the low byte of $1) times their activations
# ($5..$12: fp16 pairs (x[2j], x[2j+1])). cvt.rn.f16x2.e4m3x2 turns two bytes into two fp16 in
# one instruction, exactly (E4M3 ⊂ fp16). Out: the quad's sum, fp32.
_FP8_QUAD_PTX = tl.constexpr("""{
.reg .b32 p, acc;
.reg .b16 l, h;
.reg .f32 fl, fh;
mov.b32 {l, h}, $1; cvt.rn.f16x2.e4m3x2 p, l; mul.rn.f16x2 acc, p, $5;
cvt.rn.f16x2.e4m3x2 p, h; fma.rn.f16x2 acc, p, $6, acc;
mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 p, l; fma.rn.f16x2 acc, p, $7, acc;
cvt.rn.f16x2.e4m3x2 p, h; fma.rn.f16x2 acc, p, $8, acc;
mov.b32 {l, h}, $3; cvt.rn.f16x2.e4m3x2 p, l; fma.rn.f16x2 acc, p, $9, acc;
cvt.rn.f16x2.e4m3x2 p, h; fma.rn.f16x2 acc, p, $10, acc;
mov.b32 {l, h}, $4; cvt.rn.f16x2.e4m3x2 p, l; fma.rn.f16x2 acc, p, $11, acc;
cvt.rn.f16x2.e4m3x2 p, h; fma.rn.f16x2 acc, p, $12, acc;
mov.b32 {l, h}, acc;
cvt.f32.f16 fl, l; cvt.f32.f16 fh, h; add.f32 $0, fl, fh;
}""")


@triton.jit
def _fp8_quad_ptx(v0, v1, v2, v3, x0, x1, x2, x3, x4, x5, x6, x7):
    """Σ E4M3(w) · x over 16 weights per element: v0..v3 their words, x0..x7 the packed
    activation pairs (pack_f16x2(x[2j], x[2j+1])). GPU only."""
    return tl.inline_asm_elementwise(_FP8_QUAD_PTX, "=r,r,r,r,r,r,r,r,r,r,r,r,r",
                                     [v0, v1, v2, v3, x0, x1, x2, x3, x4, x5, x6, x7], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _fp8_word_ref(v, xa, xb, xc, xd):
    return (e4m3_value(v & 255) * xa + e4m3_value((v >> 8) & 255) * xb + e4m3_value((v >> 16) & 255) * xc
            + e4m3_value((v >> 24) & 255) * xd)


@triton.jit
def _fp8_quad_ref(v0, v1, v2, v3, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """_fp8_quad_ptx in fp32 Triton ops (any backend), from the 16 unpacked fp16 activations."""
    return (_fp8_word_ref(v0, x0, x1, x2, x3) + _fp8_word_ref(v1, x4, x5, x6, x7)
            + _fp8_word_ref(v2, x8, x9, x10, x11) + _fp8_word_ref(v3, x12, x13, x14, x15))


@triton.jit
def nvfp4_block_dot(v0, v1, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                    PTX: tl.constexpr):
    """Σ E2M1(w) · x × 2^-14 over one NVFP4 block per element of v0, v1 (its two words; k = 0..7
    from the low nibble of v0, 8..15 of v1), x0..x15 the block's activations as fp16-exact fp32
    (broadcast against the words). PTX: the paired-fp16 sequence (GPU); else fp32 Triton ops."""
    if PTX:
        return _nvfp4_block_ptx(v0, v1, pack_f16x2(x0, x4), pack_f16x2(x1, x5), pack_f16x2(x2, x6),
                                pack_f16x2(x3, x7), pack_f16x2(x8, x12), pack_f16x2(x9, x13),
                                pack_f16x2(x10, x14), pack_f16x2(x11, x15))
    return _nvfp4_block_ref(v0, v1, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)


@triton.jit
def fp8_quad_dot(v0, v1, v2, v3, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                 PTX: tl.constexpr):
    """Σ E4M3(w) · x over 16 weights per element of v0..v3 (their words, k = 0..15 from the low
    byte of v0), x0..x15 their activations as fp16-exact fp32 (broadcast against the words).
    PTX: the paired-fp16 sequence (GPU); else fp32 Triton ops."""
    if PTX:
        return _fp8_quad_ptx(v0, v1, v2, v3, pack_f16x2(x0, x1), pack_f16x2(x2, x3), pack_f16x2(x4, x5),
                             pack_f16x2(x6, x7), pack_f16x2(x8, x9), pack_f16x2(x10, x11), pack_f16x2(x12, x13),
                             pack_f16x2(x14, x15))
    return _fp8_quad_ref(v0, v1, v2, v3, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
