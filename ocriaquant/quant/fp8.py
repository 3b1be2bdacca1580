"""FP8 E4M3: weights per output channel (static), activations per token (dynamic).

Bit-exact with compressed-tensors 0.19 (FP8_DYNAMIC preset): scales are computed in the
weight's own dtype (absmax / 448 in BF16 for a BF16 model), the division x / scale too,
then a saturating cast to E4M3. The checkpoint stores the E4M3 weight and the scale in the
weight's dtype, shape [out, 1].
"""

from __future__ import annotations

import torch

from .common import FP8_DTYPE, FP8_MAX, check_finite, zero_to_eps


def _absmax_scale(x: torch.Tensor, dim: int) -> torch.Tensor:
    scale = x.abs().amax(dim=dim, keepdim=True) / torch.full((), FP8_MAX, dtype=x.dtype, device=x.device)
    eps = torch.finfo(x.dtype).eps
    return zero_to_eps(scale, eps)


def quantize_weight(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (E4M3 [out, in], scale [out, 1] in w.dtype)."""
    if w.ndim != 2:
        raise ValueError(f"{name}: FP8 weight quantization needs a 2-D [out, in] tensor, got {tuple(w.shape)}")
    check_finite(w, name)
    scale = _absmax_scale(w, dim=1)
    # "+ 0.0" turns -0.0 into +0.0 as compressed-tensors' (zero) zero-point addition does,
    # so an exact -0 weight packs as 0x00 there and here.
    q = torch.clamp(w / scale + 0.0, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    out = q.to(scale.dtype) * scale
    return out if dtype is None else out.to(dtype)


def fake_quant_weight(w: torch.Tensor, name: str = "weight") -> torch.Tensor:
    q, scale = quantize_weight(w, name)
    return dequantize(q, scale, w.dtype)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic FP8 over the last dim: (E4M3 like x, scale [..., 1] in x.dtype)."""
    scale = _absmax_scale(x, dim=-1)
    return torch.clamp(x / scale + 0.0, -FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fake_quant_activation(x: torch.Tensor) -> torch.Tensor:
    """Per-token dynamic FP8 quantize-dequantize over the last dim (x is [..., tokens, K])."""
    q, scale = quantize_activation(x)
    return q.to(x.dtype).to(scale.dtype) * scale
