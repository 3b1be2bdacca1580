"""NVFP4: E2M1 values, one E4M3 scale per 16 values along K, one FP32 global scale.

Bit-exact with compressed-tensors 0.19 (NVFP4 preset) as llmcompressor produces it:
- global scale = 448 * 6 / absmax, computed in the weight's dtype (BF16 for a BF16 model),
  then held in FP32. Members of a fused unit share it: absmax over all members.
- block scale = E4M3(global * (block absmax / 6)), block absmax / 6 in the weight's dtype, the
  product in FP32; a zero block gets 0.125.
- value = E2M1(x / (block scale / global)) in FP32, round-half-to-even on the E2M1 grid.
- packing: two values per byte, even index in the low nibble; nibble = sign << 3 | index
  into [0, 0.5, 1, 1.5, 2, 3, 4, 6]; a negative value that rounds to zero keeps its sign.
- dequantize: E2M1 (BF16) * (block scale / global) in FP32, cast to the target dtype.
"""

from __future__ import annotations

import torch

from .common import FP4_MAX, FP8_MAX, FP8_SCALE_EPS, NVFP4_GROUP, check_finite, round_to_fp8, zero_to_eps

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_SIGNED = torch.cat([E2M1_VALUES, -E2M1_VALUES])  # a nibble's value (bit 3: the sign)


def global_scale_from_absmax(absmax: torch.Tensor) -> torch.Tensor:
    """FP32 [1] global scale for a tensor (or fused unit) whose largest |value| is `absmax`.

    `absmax` keeps the dtype it was measured in: the division happens in that dtype, as in
    compressed-tensors' generate_gparam."""
    a = torch.clamp(absmax.reshape(1), min=torch.finfo(absmax.dtype).tiny)
    gs = (FP8_MAX * FP4_MAX) / a
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32)


def global_scale(*tensors: torch.Tensor) -> torch.Tensor:
    """Shared global scale of the members of a fused unit (or of one tensor)."""
    absmax = torch.stack([t.abs().amax() for t in tensors]).amax()
    return global_scale_from_absmax(absmax)


def _groups(x: torch.Tensor, name: str) -> torch.Tensor:
    k = x.shape[-1]
    if k % NVFP4_GROUP:
        raise ValueError(f"{name}: NVFP4 needs the last dim to be a multiple of {NVFP4_GROUP}, got {k}; "
                         "keep this layer in BF16 or FP8")
    return x.unflatten(-1, (k // NVFP4_GROUP, NVFP4_GROUP))


def block_scales(g: torch.Tensor, gscale: torch.Tensor) -> torch.Tensor:
    """FP32 E4M3-valued scales [..., K/16] for grouped values g [..., K/16, 16]."""
    local = g.abs().amax(-1) / torch.full((), FP4_MAX, dtype=g.dtype, device=g.device)
    s = round_to_fp8(gscale.to(g.device) * local)  # fp32 product
    return zero_to_eps(s, FP8_SCALE_EPS)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value (saturating at ±6), ties to even, sign kept (-0.1 -> -0.0).

    A value equal to the midpoint of two neighbours goes to the one of even index (0, 2, 4, 6):
    ties at 0.25, 1.25, 2.5, 5.0 round down, at 0.75, 1.75, 3.5 up. The grid steps by 0.5 below 2,
    by 1 below 4 and by 2 up to 6, so |x| / step rounded half to even (torch.round) times step is
    that value: the integer's parity is the index's (indices k, k + 2 and k + 4 in the three
    ranges), and dividing by a power of two is exact. Arithmetic only (no lookups): W4A4
    emulation runs it on every activation block."""
    mag = x.abs().clamp(max=FP4_MAX)
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0)).to(mag.dtype)
    vals = torch.round(mag / step) * step
    return torch.where(torch.signbit(x), -vals, vals)


def quantize_weight(w: torch.Tensor, gscale: torch.Tensor | None = None,
                    name: str = "weight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> (packed uint8 [out, in/2], E4M3 scales [out, in/16], FP32 global scale [1])."""
    if w.ndim != 2:
        raise ValueError(f"{name}: NVFP4 weight quantization needs a 2-D [out, in] tensor, got {tuple(w.shape)}")
    check_finite(w, name)
    g = _groups(w, name)
    gscale = global_scale(w) if gscale is None else gscale.reshape(1).to(torch.float32)
    scales = block_scales(g, gscale)
    # "+ 0.0": an exact -0 weight packs as +0, as compressed-tensors' zero-point addition makes it.
    values = round_to_e2m1(g / (scales / gscale).unsqueeze(-1) + 0.0)
    return pack(values.flatten(-2)), scales.to(torch.float8_e4m3fn), gscale


def pack(values: torch.Tensor) -> torch.Tensor:
    """E2M1-valued float [.., n] (n even) -> uint8 [.., n/2]."""
    if values.shape[-1] % 2:
        raise ValueError(f"NVFP4 packing needs an even last dim, got {values.shape[-1]}")
    mag = values.abs().float()
    idx = torch.bucketize(mag, E2M1_VALUES.to(mag.device)).to(torch.uint8)  # exact grid values -> their index
    nib = idx | (torch.signbit(values).to(torch.uint8) << 3)
    nib = nib.unflatten(-1, (values.shape[-1] // 2, 2))
    return nib[..., 0] | (nib[..., 1] << 4)


def unpack(packed: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """uint8 [.., n/2] -> E2M1 values [.., n] in dtype."""
    lut = E2M1_SIGNED.to(packed.device, dtype)
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=dtype, device=packed.device)
    out[..., 0::2] = lut[(packed & 0x0F).int()]  # int32 indices: a 4B head's weight unpacks within ~2.5 GB
    out[..., 1::2] = lut[(packed >> 4).int()]
    return out


def dequantize(packed: torch.Tensor, scales: torch.Tensor, gscale: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    vals = _groups(unpack(packed, torch.bfloat16), "packed")
    out = vals * (scales.to(torch.bfloat16) / gscale).unsqueeze(-1)  # bf16 * fp32 -> fp32
    return out.flatten(-2).to(dtype)


def fake_quant_weight(w: torch.Tensor, gscale: torch.Tensor | None = None, name: str = "weight") -> torch.Tensor:
    packed, scales, gs = quantize_weight(w, gscale, name)
    return dequantize(packed, scales, gs, w.dtype)


def fake_quant_activation(x: torch.Tensor, gscale: torch.Tensor) -> torch.Tensor:
    """W4A4 emulation (b200): dynamic per-16 block scales under a static global scale."""
    g = _groups(x, "activation")
    scales = block_scales(g, gscale)
    s = (scales / gscale.to(x.device)).unsqueeze(-1)
    q = round_to_e2m1(g / s + 0.0)
    return (q * s).flatten(-2).to(x.dtype)
