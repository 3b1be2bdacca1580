"""Qwen3.5's norms: the zero-centred RMSNorm and the gated RMSNorm at the GDN output."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.reference import gated_rmsnorm_ref


class RMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: x / rms(x) * (1 + w), in fp32, cast back."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


# Qwen3_5RMSNormGated (norm in fp32, weight in the input dtype, then silu(gate) in fp32): the torch
# backend runs the kernels' reference itself (kernels/gated_rmsnorm.py is its one-launch form)
gated_rmsnorm = gated_rmsnorm_ref
