"""Tile shapes for the M = 1 GEMVs, by format and weight shape: what scripts/bench_kernels.py
found fastest on an H200 (BENCHMARKS.md, 2026-12-02) on Qwen3.5-4B's shapes, written as
rules so that the fused shapes in between (q/k/v, the four GDN input projections) get one.

- BF16 (fp32 CUDA-core kernel, gemv_m1.py): wide K (≥ 4096: out_proj, o_proj, down_proj;
  N = 2560) has few output tiles, so narrow ones (8 rows) with long K steps keep more CTAs
  streaming; K = 2560 (input projections, lm_head) takes 16-row tiles, 512-wide K steps.
- FP8 and NVFP4 (paired-fp16 kernels, half2.py; session 5's sweep, with the next-tile
  prefetch): 16–32-row tiles at K = 2560, 64 rows for NVFP4's lm_head (its activation work
  is shared by more rows); down_proj (K = 9216) splits K 8 ways for FP8, and o_proj /
  out_proj (K = 4096) 8 ways for NVFP4.
"""

from __future__ import annotations


def m1_tile(kind: str, n: int, k: int) -> dict:
    """Keyword arguments for gemv_bf16 / gemv_fp8 / gemv_nvfp4 at M = 1."""
    wide_k = k >= 4096 and k % 1024 == 0
    head = n >= 65536  # the lm_head: many CTAs already, no split
    if kind == "fp8":  # the paired-fp16 kernel (half2.py)
        if wide_k:
            return dict(block_n=8, block_k=1024) if k < 8192 else dict(block_n=32, block_k=512, split_k=8)
        return dict(block_n=32, block_k=256) if head else dict(block_n=16, block_k=512)
    if kind == "nvfp4":
        if wide_k:
            return dict(block_n=32, block_k=256, split_k=8) if k < 8192 else dict(block_n=64, block_k=256)
        return dict(block_n=64 if head else 32, block_k=256)
    if wide_k:
        return dict(block_n=8, block_k=1024)
    return dict(block_n=16, block_k=512 if k % 512 == 0 else 256)
