"""Shared constants and checks for the FP8 / NVFP4 numerics."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP4_MAX = 6.0
NVFP4_GROUP = 16
# compressed-tensors replaces a zero scale by the scale dtype's eps: 0.125 for an E4M3 scale,
# torch.finfo(dtype).eps otherwise. Matching it keeps all-zero rows and blocks bit-exact.
FP8_SCALE_EPS = 0.125


def check_finite(t: torch.Tensor, name: str) -> None:
    if not torch.isfinite(t).all():
        n_bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name}: {n_bad} NaN/Inf value(s) of {t.numel()}; cannot quantize a non-finite tensor")


def zero_to_eps(scale: torch.Tensor, eps: float) -> torch.Tensor:
    # torch.full, not torch.tensor (here, in fp8 and nvfp4): no host copy, which a CUDA graph cannot capture
    return torch.where(scale == 0, torch.full((), eps, dtype=scale.dtype, device=scale.device), scale)


def round_to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even to E4M3, returned in x's dtype."""
    return torch.clamp(x, -FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(x.dtype)
