"""FP8 W8A8 weight-streaming GEMV for decode (M = 1…64): y = (x_q · x_scale) @ (W_q · w_scale)ᵀ.

Layouts are the compressed-tensors FP8_DYNAMIC ones export writes: W_q E4M3 [N, K], w_scale
[N, 1] (per output channel); activations are E4M3 per token with an fp32 scale [M, 1]
(`quant_fp8_per_token`, `add_rmsnorm`, or `silu_mul_quant` in the MLP). M = 1 runs on CUDA
cores (gemv_m1.py), larger M on the FP8 tensor cores (gemv_dot.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv_dot import gemv_dot
from .gemv_m1 import gemv_m1
from .rounding import fp8_token_codes, fp8_token_scale

def gemv_fp8(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
             out: torch.Tensor | None = None, block_n: int = 16, block_k: int = 256,
             split_k: int | None = None, num_warps: int = 4, num_stages: int = 4,
             path: str = "auto") -> torch.Tensor:
    """x_q E4M3 [M, K], x_scale fp32 [M, 1], w_q E4M3 [N, K], w_scale [N, 1] -> bf16 [M, N].
    path: "fma" (M = 1 only, CUDA cores: gemv_m1.py), "dot" (tensor cores), "auto" (fma at M = 1)."""
    m, k = x_q.shape
    if w_q.shape[1] != k:
        raise ValueError(f"gemv_fp8: x has K={k} but the weight is {tuple(w_q.shape)}")
    if m > 64:
        raise ValueError(f"gemv_fp8 is for decode (M <= 64), got M={m}; use torch._scaled_mm above that")
    if path == "fma" or (path == "auto" and m == 1):
        return gemv_m1(x_q, w_q, x_scale, w_scale, out=out, block_n=block_n, block_k=block_k, split_k=split_k,
                       num_warps=num_warps, num_stages=num_stages)
    return gemv_dot(x_q, w_q, x_scale, w_scale, out=out, block_n=block_n, block_k=block_k, split_k=split_k,
                    num_warps=num_warps, num_stages=num_stages)


@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BK: tl.constexpr):
    row = tl.program_id(0)
    rk = tl.arange(0, BK)
    amax = tl.zeros((BK,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + row * stride_xm + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = fp8_token_scale(tl.max(amax, 0))
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + row * stride_xm + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * K + k0 + rk, fp8_token_codes(x, scale).to(tl.uint8), mask=k0 + rk < K)
    tl.store(s_ptr + row, scale)


def quant_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [M, K] -> (E4M3 [M, K], fp32 scale [M, 1]), numerics of quant.fp8.fake_quant_activation."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    _quant_fp8_kernel[(m,)](x, q.view(torch.uint8), s, k, x.stride(0), BK=min(4096, triton.next_power_of_2(k)), num_warps=8)
    return q, s


def gemv_fp8_ref(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Plain torch, float64: the exact product of the dequantized operands."""
    x = x_q.double() * x_scale.double()
    w = w_q.double() * w_scale.double()
    return x @ w.T
