"""BF16 weight-streaming GEMV for decode (M = 1…64): y = x · Wᵀ, what the BF16 layers of a
plan (and a BF16 lm_head) run instead of cuBLAS, which reaches 40–55 % of the copy bandwidth
at batch 1 on Qwen3.5-4B's shapes. M = 1 runs on CUDA cores (gemv_m1.py); larger M on the
tensor cores (gemv_dot.py), as gemv_fp8 does.
"""

from __future__ import annotations

import torch

from .gemv_dot import gemv_dot
from .gemv_m1 import gemv_m1


def gemv_bf16(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, block_n: int = 16,
              block_k: int = 256, split_k: int | None = None, num_warps: int = 4, num_stages: int = 4,
              path: str = "auto", pdl: bool | None = None, silu: bool = False) -> torch.Tensor:
    """x bf16 [M, K], w bf16 [N, K] -> bf16 [M, N]. path: "fma" (M = 1 only), "dot" (tensor
    cores), "auto" (fma at M = 1). silu (M = 1): w is a fused [gate; up], the result
    silu(gate) · up [1, N/2] (gemv_m1)."""
    m, k = x.shape
    if w.shape[1] != k or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise ValueError(f"gemv_bf16: x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype} must be "
                         "bf16 with the same K")
    if m > 64:
        raise ValueError(f"gemv_bf16 is for decode (M <= 64), got M={m}; use F.linear above that")
    if silu and (m != 1 or path == "dot"):
        raise ValueError(f"gemv_bf16: silu·mul in the epilogue is the M = 1 CUDA-core path, got M={m}, path {path!r}")
    if path == "fma" or (path == "auto" and m == 1):
        return gemv_m1(x, w, out=out, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                       pdl=pdl, silu=silu)
    return gemv_dot(x, w, out=out, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                    num_stages=num_stages)

