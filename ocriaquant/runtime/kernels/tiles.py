"""Tile shapes for the M = 1 GEMVs, by format and weight shape: what scripts/bench_kernels.py
found fastest on an H200 (BENCHMARKS.md, 2026-12-02) on Qwen3.5-4B's shapes, written as
rules so that the fused shapes in between (q/k/v, the four GDN input projections) get one.

- Wide K (≥ 4096: out_proj, o_proj, down_proj; N = 2560): few output tiles, so narrow ones
  (8 rows) with long K steps keep more CTAs streaming.
- K = 2560 (the input projections, lm_head): 16-row tiles, 512-wide K steps for BF16 / FP8;
  the NVFP4 decoder does best on 64-row tiles, whose activations are loaded once for 4 rows.
- NVFP4 splits K twice as finely as splitk.geometry would: its CTAs are compute-bound, more of
  them hide more latency.
"""

from __future__ import annotations


def m1_tile(kind: str, n: int, k: int) -> dict:
    """Keyword arguments for gemv_bf16 / gemv_fp8 / gemv_nvfp4 at M = 1."""
    wide_k = k >= 4096 and k % 1024 == 0
    if kind in ("nvfp4", "fp8"):  # the paired-fp16 kernels (half2.py)
        if wide_k:
            return dict(block_n=32, block_k=256 if kind == "nvfp4" else 512, split_k=k // 512)
        if kind == "nvfp4":
            return dict(block_n=64 if n >= 65536 else 32, block_k=256, split_k=None if n >= 65536 else 2)
        return dict(block_n=32, block_k=512)
    if wide_k:
        return dict(block_n=8, block_k=1024)
    return dict(block_n=16, block_k=512 if k % 512 == 0 else 256)
