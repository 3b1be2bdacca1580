"""FP32 -> BF16 and FP32 -> E4M3 rounding in integer arithmetic, shared by the quantizing kernels.

Triton's interpreter (what CI runs the kernels with) truncates fp32 -> bf16 and rounds
fp32 -> float8e4nv wrongly (ties away from zero, a carry into the exponent lost: 125.5
became 64), so kernels that relied on `.to()` for these could not be checked on the CPU.
These do what the GPU's `cvt.rn` instructions and torch do — round half to even — on either.
E4M3 codes are returned as bytes; kernels store them through a uint8 view of the tensor.
"""

import triton
import triton.language as tl


@triton.jit
def e4m3_bits(v):
    """fp32 values already clamped to [-448, 448] -> E4M3 codes (int32 in 0..255)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag_bits = bits & 0x7FFFFFFF
    a = mag_bits.to(tl.float32, bitcast=True)
    # Normal range: round the fp32 mantissa to 3 bits, half to even; a carry moves the exponent.
    rounded = (mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    # Subnormal range (< 2^-6): multiples of 2^-9, half to even via the 2^23 trick.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    return code | (sign << 7)


@triton.jit
def round_bf16(v):
    """fp32 -> the nearest bf16 value (half to even), kept in fp32. Finite inputs only."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_value(code):
    """E4M3 codes (int32, 0..255, no NaN) -> fp32 values: subnormal m * 2^-9, else
    2^(e-7) * (1 + m/8). Integer decoding, for the same interpreter reason as above."""
    e = (code >> 3) & 15
    mant = (code & 7).to(tl.float32)
    mag = tl.where(e == 0, mant * 0.001953125, tl.exp2((e - 7).to(tl.float32)) * (1.0 + mant * 0.125))
    return tl.where((code & 128) != 0, -mag, mag)


FP8_MAX = tl.constexpr(448.0)  # a constexpr: @jit code can read no other globals


@triton.jit
def fp8_token_scale(amax):
    """A row's absmax -> its FP8 scale as compressed-tensors computes it on BF16 activations:
    amax / 448 by IEEE division (as torch), rounded to bf16; 0 becomes bf16's eps."""
    scale = round_bf16(tl.math.div_rn(amax, FP8_MAX))
    return tl.where(scale == 0.0, 0.0078125, scale)


@triton.jit
def fp8_token_codes(v, scale):
    """fp32 values (bf16-exact) and their row scale -> E4M3 codes (int32), compressed-tensors' rounding."""
    q = round_bf16(tl.math.div_rn(v, scale))
    return e4m3_bits(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))
