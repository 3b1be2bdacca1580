"""Paired fp16 arithmetic for the batch-1 GEMVs of quantized weights (gemv_nvfp4, gemv_fp8).

At M = 1 every weight streams once and costs instructions of its own. Decoding it to fp32 and
multiplying there took, per weight, a conversion (a quarter-rate instruction on Hopper), an
FFMA and an activation load or conversion: gemv_nvfp4 reached 18–35 % of the copy bandwidth
and gemv_fp8 41–61 %, bound by those instructions, not by memory.
Here two weights are decoded into the two halves of one register and multiplied by two
activations with one `fma.rn.f16x2`; a block's products are summed in fp16 and only the block
sum is converted to fp32, where the block scale multiplies it.

The activations come ready from the kernel that produced them (add_rmsnorm, silu_mul_quant,
quant_fp8_per_token): scaled by a power of two so that no fp16 product or block sum can
overflow, rounded to fp16 and packed two to a 32-bit word in the order the weight decoder
produces its halves. Preparing them inside the GEMV cost every thread that held a K-tile a
load, a conversion, a multiply and a pack per activation, repeated by each thread of the same
column: ~1.3 of the ~5.4 instructions per weight of NVFP4's 2560-wide shapes (sm_90 SASS), plus
a pass over x for its maximum. Now a thread loads eight words per 16 weights.

- FP8 (`fp8_pairs`): the E4M3 codes × 2^-8 as fp16, in K order — exact, since E4M3 ⊂ fp16.
- NVFP4 (`nvfp4_pairs`): each 16-value block scaled by 2^(14 - e), e = ⌊log2 max|x|⌋ of the
  block, so that its largest value lies in [2^14, 2^15); with E2M1 · 2^-14 weights every
  product is then < 12 and a block sum < 192. Power-of-two scales keep BF16 values exact in
  fp16 (11 significant bits against BF16's 8) down to 2^-29 of the block's maximum; the
  block's 2^e multiplies its fp32 sum beside the weight's block scale.

Under TRITON_INTERPRET=1 (CI) inline PTX cannot run; the same sums are then taken in fp32 from
the same fp16 values (`_*_f32`), which agrees with the GPU's fp16 block sums to fp16
rounding — what the kernel tests bound against the float64 references (reference.py).
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
def unpack_f16x2(w):
    """int32 words from pack_f16x2 -> (lo, hi) as fp32."""
    lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def fp8_pairs(codes):
    """E4M3 codes (int32) -> their values × 2^-8 in fp16, stored in K order for gemv_fp8's
    batch-1 kernel, which reads them two to a 32-bit word. E4M3 · E4M3 products reach 448²,
    past fp16; × 2^-8 they stay under 784 (x ≤ 1.75), each half of a paired 16-weight sum
    under 6,272."""
    return (e4m3_value(codes) * 0.00390625).to(tl.float16)


@triton.jit
def nvfp4_pairs(x):
    """fp32 [NBLK, 16] (BF16 values), one NVFP4 block of activations per row -> (int32 words
    [NBLK, 8] in the decoder's order — (x[i], x[i+4]) for i = 0..3, then (x[8+i], x[12+i]) —,
    fp32 [NBLK]: 2^e, what the block's sum is multiplied by). See the module docstring."""
    nblk: tl.constexpr = x.shape[0]
    amax = tl.max(tl.abs(x), 1)
    e = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -100)  # ⌊log2⌋; 0 and tiny: -100
    x_mul = ((141 - e) << 23).to(tl.float32, bitcast=True)    # 2^(14 - e)
    t = tl.permute(tl.reshape(x * x_mul[:, None], (nblk, 2, 2, 4)), (0, 1, 3, 2))  # [blk, half, i, +0/+4]
    lo, hi = tl.split(t)
    return tl.reshape(pack_f16x2(lo, hi), (nblk, 8)), ((127 + e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def store_nvfp4_pairs(x, xw_ptr, xs_ptr, k0, K):
    """Activations x (fp32 [BLOCK], elements k0 … of a row of K) -> their nvfp4_pairs words and
    block scales, stored at xw_ptr / xs_ptr (the row's start). What producers call on the part
    of a row they hold."""
    nblk: tl.constexpr = x.shape[0] // 16
    words, scales = nvfp4_pairs(tl.reshape(x, (nblk, 16)))
    rw = k0 // 2 + tl.arange(0, 8 * nblk)
    tl.store(xw_ptr + rw, tl.reshape(words, (8 * nblk,)), mask=rw < K // 2)
    rs = k0 // 16 + tl.arange(0, nblk)
    tl.store(xs_ptr + rs, scales, mask=rs < K // 16)


@triton.jit
def load_pairs(p, mask):
    """The eight activation words at p + 0 … 7 (p: one pointer per K-block column of a GEMV tile),
    each as a [1, columns] row that broadcasts against the tile's weight words."""
    return (tl.load(p, mask=mask, other=0)[None, :], tl.load(p + 1, mask=mask, other=0)[None, :],
            tl.load(p + 2, mask=mask, other=0)[None, :], tl.load(p + 3, mask=mask, other=0)[None, :],
            tl.load(p + 4, mask=mask, other=0)[None, :], tl.load(p + 5, mask=mask, other=0)[None, :],
            tl.load(p + 6, mask=mask, other=0)[None, :], tl.load(p + 7, mask=mask, other=0)[None, :])


@triton.jit
def load_after(p, after):
    """The 32-bit words at p (GPU only), by a pure asm load ordered behind `after` (see load_pairs_v4)."""
    return tl.inline_asm_elementwise("ld.global.b32 $0, [$1];", "=r,l,r", [p.to(tl.int64, bitcast=True), after],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def load_pairs_v4(p, after=None):
    """load_pairs without a mask, GPU only: the eight words at p + 0 … 7 (32-byte aligned) as two
    16-byte loads (PTX ld.global.v4) instead of eight 4-byte ones — Triton issues one load per
    tl.load, and the eight words are eight tensors. In gemv_nvfp4's batch-1 loop they were 16 of a
    thread's 29 loads a tile, and the L1/TEX pipe, not DRAM, was the one warps waited on.

    after None: a non-pure asm, which a compiler may not move above the PDL wait that orders it after
    its producer — but which keeps the default layout of its shape, so that its results are converted
    to the layout of the tile that uses them. In gemv_nvfp4's batch-1 loop that conversion went through
    shared memory: up to 24 bar.sync a K-tile (sm_90 SASS, Triton 3.9); in gemv_fp8's the two layouts
    hold the same words and the conversion costs nothing. `after`: a scalar that exists only after the
    wait (splitk.after_wait); the asm is then pure, so Triton lays it out as its users need, and takes
    `after` as an operand it does not read, so it cannot be moved above the wait either."""
    a = p.to(tl.int64, bitcast=True)
    dep = 0 if after is None else after  # the unread operand: a constant where the asm is not pure
    x0, x1, x2, x3 = tl.inline_asm_elementwise("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l,r", [a, dep],
                                               dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                               is_pure=after is not None, pack=1)
    x4, x5, x6, x7 = tl.inline_asm_elementwise("ld.global.v4.b32 {$0, $1, $2, $3}, [$4+16];", "=r,=r,=r,=r,l,r",
                                               [a, dep], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                               is_pure=after is not None, pack=1)
    return (x0[None, :], x1[None, :], x2[None, :], x3[None, :], x4[None, :], x5[None, :], x6[None, :], x7[None, :])


@triton.jit
def e2m1_times_2m14(nib):
    """Integer nibbles -> fp16 values E2M1(nib) × 2^-14: the three magnitude bits placed at bit 9
    of an fp16 (exponent field = E2M1 exponent, top mantissa bit = E2M1 mantissa) are the E2M1
    value times 2^-14 — subnormal for 0 and ±0.5, exactly as E2M1 itself; the sign (bit 3) goes
    to bit 15. (The tensor-core path's decode; the batch-1 path reads M1_LAYOUT words.)"""
    bits = ((nib & 7) << 9) | ((nib & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


# The batch-1 NVFP4 weight words (gemv_nvfp4.pack_m1 writes them at load time). A block's 16
# weights fill two 32-bit words; word w, pair j (0..3) holds weights (8w + j, 8w + j + 4), the
# order of the activation pairs (nvfp4_pairs). Pair j decodes as
#     ((word << MAG_j) & 0x0E000E00) | ((word << SIGN_j) & 0x80008000)
# — magnitudes at fp16 bits 9-11 and 25-27, signs at 15 and 31: e2m1_times_2m14 on both halves.
# In the checkpoint's nibble order that took 15 integer ops a word; no bit order lets one shift
# serve all four pairs (their 4-bit patterns {9, 10, 11, 15} cannot tile 16 positions), and this
# one, found by exhaustive search, needs 11: pair 0 a mask, pair 1 a shift and a mask, pairs 2-3
# two shifts, two masks and an or each. Layout: (MAG_j, SIGN_j).
M1_LAYOUT = ((0, 0), (3, 3), (6, 1), (9, 2))


def _m1_pair_ptx(word: str, j: int, x: str, first: bool) -> str:
    mag, sign = M1_LAYOUT[j]
    if mag == sign:
        src = word if mag == 0 else "t"
        code = ("" if mag == 0 else f"shl.b32 t, {word}, {mag}; ") + f"and.b32 p, {src}, 0x8E008E00; "
    else:
        s_src = word if sign == 0 else "u"
        code = (f"shl.b32 t, {word}, {mag}; and.b32 t, t, 0x0E000E00; "
                + ("" if sign == 0 else f"shl.b32 u, {word}, {sign}; ")
                + f"and.b32 u, {s_src}, 0x80008000; or.b32 p, t, u; ")
    return code + (f"mul.rn.f16x2 acc, p, {x};" if first else f"fma.rn.f16x2 acc, p, {x}, acc;")


# One NVFP4 block in M1_LAYOUT ($1, $2: its words) times its activations ($3..$10: per word,
# the fp16 pairs (x[i], x[i+4]) for i = 0..3). Out: the block's sum × 2^-14, fp32.
_NVFP4_BLOCK_PTX = tl.constexpr("{\n.reg .b32 t, u, p, acc;\n.reg .b16 l, h;\n.reg .f32 fl, fh;\n"
                                + "\n".join(_m1_pair_ptx(f"${1 + w}", j, f"${3 + 4 * w + j}", w == 0 and j == 0)
                                            for w in range(2) for j in range(4))
                                + "\nmov.b32 {l, h}, acc;\ncvt.f32.f16 fl, l; cvt.f32.f16 fh, h; add.f32 $0, fl, fh;\n}")


@triton.jit
def _nvfp4_block_ptx(v0, v1, x0, x1, x2, x3, x4, x5, x6, x7):
    """Σ E2M1(w) · x × 2^-14 over one block per element: v0, v1 its two words (M1_LAYOUT),
    x0..x7 the packed activation pairs (x0..x3 for v0, x4..x7 for v1). GPU only."""
    return tl.inline_asm_elementwise(_NVFP4_BLOCK_PTX, "=r,r,r,r,r,r,r,r,r,r,r",
                                     [v0, v1, x0, x1, x2, x3, x4, x5, x6, x7], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _m1_pair(v, MAG: tl.constexpr, SIGN: tl.constexpr):
    """Pair (MAG, SIGN) of M1_LAYOUT words v -> the two weights × 2^-14, fp32 (Triton ops)."""
    bits = ((v << MAG) & 0x0E000E00) | ((v << SIGN) & -2147450880)  # 0x80008000 as an int32
    lo = (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = ((bits >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _nvfp4_pair_f32(v, p, MAG: tl.constexpr, SIGN: tl.constexpr):
    """Pair (MAG, SIGN) of words v times the activation pair p, in fp32."""
    w_lo, w_hi = _m1_pair(v, MAG, SIGN)
    x_lo, x_hi = unpack_f16x2(p)
    return w_lo * x_lo + w_hi * x_hi


@triton.jit
def _nvfp4_block_f32(v0, v1, p0, p1, p2, p3, p4, p5, p6, p7):
    """_nvfp4_block_ptx in fp32 Triton ops (any backend); the shifts are M1_LAYOUT's."""
    return (_nvfp4_pair_f32(v0, p0, 0, 0) + _nvfp4_pair_f32(v0, p1, 3, 3) + _nvfp4_pair_f32(v0, p2, 6, 1)
            + _nvfp4_pair_f32(v0, p3, 9, 2) + _nvfp4_pair_f32(v1, p4, 0, 0) + _nvfp4_pair_f32(v1, p5, 3, 3)
            + _nvfp4_pair_f32(v1, p6, 6, 1) + _nvfp4_pair_f32(v1, p7, 9, 2))


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
def _fp8_pair_f32(t, p):
    """Bytes 0 and 1 of word t times the activation pair p, in fp32."""
    x_lo, x_hi = unpack_f16x2(p)
    return e4m3_value(t & 255) * x_lo + e4m3_value((t >> 8) & 255) * x_hi


@triton.jit
def _fp8_quad_f32(v0, v1, v2, v3, p0, p1, p2, p3, p4, p5, p6, p7):
    """_fp8_quad_ptx in fp32 Triton ops (any backend)."""
    return (_fp8_pair_f32(v0, p0) + _fp8_pair_f32(v0 >> 16, p1) + _fp8_pair_f32(v1, p2) + _fp8_pair_f32(v1 >> 16, p3)
            + _fp8_pair_f32(v2, p4) + _fp8_pair_f32(v2 >> 16, p5) + _fp8_pair_f32(v3, p6)
            + _fp8_pair_f32(v3 >> 16, p7))


@triton.jit
def nvfp4_block_dot(v0, v1, p0, p1, p2, p3, p4, p5, p6, p7, PTX: tl.constexpr):
    """Σ E2M1(w) · x × 2^-14 over one NVFP4 block per element of v0, v1 (its two words in
    M1_LAYOUT), p0..p7 the block's activation words (nvfp4_pairs; broadcast against the words).
    PTX: the paired-fp16 sequence (GPU); else fp32 Triton ops."""
    if PTX:
        return _nvfp4_block_ptx(v0, v1, p0, p1, p2, p3, p4, p5, p6, p7)
    return _nvfp4_block_f32(v0, v1, p0, p1, p2, p3, p4, p5, p6, p7)


@triton.jit
def fp8_quad_dot(v0, v1, v2, v3, p0, p1, p2, p3, p4, p5, p6, p7, PTX: tl.constexpr):
    """Σ E4M3(w) · x over 16 weights per element of v0..v3 (their words, k = 0..15 from the low
    byte of v0), p0..p7 their activation words (fp8_pairs, two to a word in K order; broadcast
    against the words). PTX: the paired-fp16 sequence (GPU); else fp32 Triton ops."""
    if PTX:
        return _fp8_quad_ptx(v0, v1, v2, v3, p0, p1, p2, p3, p4, p5, p6, p7)
    return _fp8_quad_f32(v0, v1, v2, v3, p0, p1, p2, p3, p4, p5, p6, p7)
