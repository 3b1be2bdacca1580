"""Tile shapes for the M = 1 GEMVs, by format and weight shape: what scripts/bench_kernels.py
found fastest on an H200 (BENCHMARKS.md, 2026-12-02) on Qwen3.5-4B's shapes, written as
rules so that the fused shapes in between (q/k/v, the four GDN input projections) get one.

- BF16 (fp32 CUDA-core kernel, gemv_m1.py): wide K (≥ 4096: out_proj, o_proj, down_proj;
  N = 2560) has few output tiles, so narrow ones with long K steps keep more CTAs streaming;
  K = 2560 takes 512-wide K steps, 16-row tiles for the lm_head, 8-row ones for the input
  projections (8192 ≤ N ≤ 16384: GDN's 12352, attention's 10240). Session 15 re-swept these
  inside the decode step once the K loop was a cp.async pipeline (H200, BF16 plan, batch 1):
  the 8-row input projections took 2.701 -> 2.684 ms a step; 32 × 256 or 16 × 256 there,
  16 × 512 / 8 × 512 / a doubled split on the wide-K shapes, 16 × 256 / 32 × 256 gate_up tiles
  were all slower, the lm_head at 8 or 32 rows equal. Session 20 swept them again (norm slices
  and attention chunks had changed the step around them): the fused gate_up on 4 rows (was 16;
  silu · mul in the epilogue) and the wide-K shapes on 4 rows × 1024 over 8 warps (was 8 rows
  on 4) took the BF16 step from 2.646 to 2.527 ms (bench: 2.628 -> 2.527 ms, 79.4 % of its
  roofline). More CTAs stream at once: the gate_up's 18432 rows become 2304 CTAs of 4 + 4
  rows, out_proj's 2560 rows 640 row tiles. 2 rows, 16 warps, 8 × 2048, 4 × 1024 on 4 warps,
  8 × 512 on the wide K were slower; 16 or 8 × 256 input projections too.
- FP8 and NVFP4 (paired-fp16 kernels, half2.py, activations ready from the producer; session
  6's sweep): the lm_head takes 64-row tiles, 256-wide K steps; the 2560-wide K input
  projections 32 rows × 512 (gate+up) or, for the narrower GDN / q-k-v projections (N ≤ 12288),
  wide tiles of 8 warps (FP8 256 × 128, NVFP4 64 × 512); down_proj (K ≥ 8192) 64 × 512 on 8
  warps split 8 ways; out_proj / o_proj (K = 4096) FP8 64 × 256 split 8, NVFP4 16 × 512 split 4.
  Session 7's sweep with the M1_LAYOUT decoder preferred other NVFP4 tiles in isolation (down_proj
  32 × 512 split 8, out_proj 8 × 1024); inside the decode step they were 15–25 µs slower at
  batch 1 on the same machine (BENCHMARKS.md), so these stay. Session 16, once the weights
  loaded 16 bytes at a time, re-swept FP8 / NVFP4 inside the step: NVFP4 down_proj 128 × 512
  (split 8, 8 warps) took the mixed plan from 1.94 to 1.865 ms; the FP8 input-projection and
  out_proj alternatives were equal or slower. Session 20 swept the FP8 input projections inside
  the step again (scripts/ab_step.py, mixed batch 1, bench's cache length): GDN's 12352 × 2560,
  until then on the 32 × 512 / 4-warp fallback (it is past 12288), and attention's 10240 × 2560
  (256 × 128 / 8 warps) both run fastest at 64 × 512 on 8 warps — 1.705 -> 1.679 ms a step
  together; 32 or 128 rows, 16 warps, 4 warps on q/k/v within 10 µs of it, 1024-wide K steps
  +22 to +84 µs, 128 × 256 / 128 × 128 / 256 × 128 on 4 warps for GDN's equal or slower. The
  12288 member shape alone: 11.2 -> 10.0 µs. Narrower FP8 shapes (N < 8192) keep 256 × 128.
  The same session moved FP8 out_proj / o_proj from 64 × 256 on 4 warps to 128 × 256 on 8
  (split 8 both): 1.689 -> 1.672 ms a step, 1.685 -> 1.679 in a 4-round re-run; 64 × 512,
  32 × 512 and 64 × 256 on 8 warps were slower or equal, as were other FP8 down_proj
  (2560 × 9216) and gate_up tiles in the latency table. That out_proj quantizes its own input
  (kind fp8_qx): each CTA quantizes its K-slice, so it keeps a split tile; unsplit narrow tiles
  would quantize the whole row in every CTA. Fed ready activations (kind fp8, nvfp4), K = 4096
  runs fastest as narrow rows whole in one K-tile, unsplit, on 4 warps (session 24, alone on an
  H200, BENCHMARKS.md): FP8 8 × 4096 3.42 µs against 5.37 for 128 × 256 split 8, NVFP4 4 × 4096
  3.14 against 6.31 for 16 × 512 split 4. Each CTA issues all its weight loads before its PDL
  wait, and no split-K reduction is left at its tail. On 2560 × 9216 the same idea lost (FP8
  8 × 1024 unsplit 8.38 µs against 7.83; NVFP4 4 × 1024 10.1 against 7.25). The same session's
  batch-1 sweep (bench_kernels --only m1) moved the NVFP4 down_proj from 128 × 512 split 8
  (launched as 6) to 32 × 1024 on 8 warps split 3: 7.25 -> 7.14 µs alone, mixed batch 1
  1.644 -> 1.632 ms in a 4-round ab_step (faster in every round). Session 27 swept it inside the step again
  (mixed batch 1, 4 rounds a run): 8 × 1024 on 2 warps, split 3 (960 CTAs of 64 threads) took it from 1.623-1.625
  to 1.604-1.605 ms in three runs, faster in every round; 16 × 1024 on 4 warps 1.608-1.611; 32 × 1024 on 4, 64 × 512
  split 6 on 8 or 4, 16 × 512 split 6, 4 × 1024 on 1-2 warps, 8 × 1024 on 1 warp or split 9 equal or slower. Alone
  the 8-warp tile had been the faster (BENCHMARKS.md, session 27).

Above batch 1 FP8 runs on the tensor cores, gemv_dot's swapped form (dot_tile): 64 weight rows
a CTA on one warpgroup, unsplit where K = 2560 (K-steps of 256 on 3 stages up to batch 32, of 128
on 4 above). Swept on an H200 (scripts/bench_kernels.py --only fp8, session 22) over 32-128 rows,
K-steps of 128-512, 3-4 stages and ½-4 × the automatic split at batch 8, 32, 64: each shape's best
there is within 12 % of the rule's tile (mlp_up at batch 8: 64 × 128 / 4 stages, 13.7 µs against
15.4). Two warpgroups (8 warps) were slower wherever tried. Session 23 swept deeper pipelines on the
N = 2560 shapes, which have only 40 row tiles: K = 4096 (out_proj / o_proj) now takes K-steps of
256 on 6 stages, unsplit (batch 8 / 32 / 64: 5.95 / 6.38 / 7.51 µs against 6.50 / 7.06 / 7.96 for
512 on 3), down_proj (K ≥ 8192) K-steps of 128 on 8 stages split 3 at every batch (8.93 / 10.19 /
11.22 µs against 9.44 / 11.08 / 13.10 for split 6 / 6 / 2). For K = 2560 the deeper pipelines
were 8-20 % slower.

Register caps (Triton's maxnreg) on the batch-1 NVFP4 kernel, session 38 on an H100 (BENCHMARKS.md): a cap is
also a scheduling hint to ptxas, which without one kept the down_proj tile at 96 registers and issued most of the
next K-tile's weight loads only after the current tile's activations arrived. Alone, a cap made the wide-K tiles
faster (down_proj 8 × 1024 at 128 registers: 8.24-8.41 -> 7.70-7.93 µs; 2560×4096 on 8 × 4096 at 168: 3.31 ->
3.18-3.20 µs against the rule's 4 × 4096); inside the step they were slower (mixed batch 1 1.926 -> 1.946 ms with the
down_proj cap; nvfp4 2.201 -> 2.206 with the 8 × 4096 one), so no rule sets one. A likely reason, not measured:
more registers a CTA (down_proj 10 -> 8 CTAs a SM) leave fewer CTAs room beside the kernel before, which a PDL launch
overlaps. The override's fifth number for kind nvfp4 sets a cap, to sweep one inside the step.

OCRIAQUANT_TILE_<kind>_<n>x<k>="block_n,block_k,num_warps[,split_k]" replaces the rule for one
shape (kind: bf16, fp8, fp8_qx (the FP8 GEMV that quantizes its input), nvfp4, nvfp4_silu, and
fp8_dot for the tensor-core path at every batch above 1, which also takes the pipeline's depth:
"block_n,block_k,num_warps,split_k,num_stages"; nvfp4 takes a register cap there,
"block_n,block_k,num_warps,split_k,maxnreg"):
how a tile is re-swept inside the decode step, or tuned for a GPU other than the H200, without
editing code.
"""

from __future__ import annotations

import os


def m1_tile(kind: str, n: int, k: int) -> dict:
    """Keyword arguments for gemv_bf16 / gemv_fp8 / gemv_nvfp4 at M = 1; kind "nvfp4_silu":
    gemv_nvfp4_silu (whole 16-value blocks per tile, no split)."""
    override = tile_override(kind, n, k)
    if override is not None:
        return override
    bk = 512 if k % 512 == 0 else 256
    if kind == "nvfp4_silu":
        return dict(block_n=32, block_k=bk)
    wide_k = k >= 4096 and k % 1024 == 0
    head = n >= 65536  # the lm_head: many CTAs already, no split
    in_proj = 8192 <= n <= 16384  # the fused input projections (GDN's four, attention's q/k/v)
    if kind in ("fp8", "fp8_qx", "nvfp4"):  # the paired-fp16 kernels (half2.py)
        fp8 = kind != "nvfp4"
        if head:
            return dict(block_n=64, block_k=256)
        if wide_k and k >= 8192 and fp8:
            # split 8 asked; launch_plan rounds a split to whole K-tiles: 9216 / 8 -> 1536, 6 splits
            return dict(block_n=64, block_k=512, split_k=8, num_warps=8)
        if wide_k and k >= 8192:  # NVFP4 down_proj: 1024-wide K-steps, 3 splits (3 partials for the norm), small CTAs
            return dict(block_n=8, block_k=1024, split_k=3, num_warps=2)
        if wide_k and kind == "fp8_qx":  # out_proj / o_proj quantizing their input (gemv_fp8_quantizing)
            return dict(block_n=128, block_k=256, split_k=8, num_warps=8)
        if wide_k:  # out_proj / o_proj fed ready activations: each CTA's rows whole in one K-tile
            return dict(block_n=8 if fp8 else 4, block_k=min(4096, k & -k), split_k=1, num_warps=4)
        if fp8 and in_proj and bk == 512:
            return dict(block_n=64, block_k=512, num_warps=8)
        if n <= 12288 and bk == 512:
            return dict(block_n=256, block_k=128, num_warps=8) if fp8 else dict(block_n=64, block_k=512, num_warps=8)
        return dict(block_n=32, block_k=bk)
    if wide_k:
        return dict(block_n=4, block_k=1024, num_warps=8)
    if in_proj:
        return dict(block_n=8, block_k=bk)
    # the fused gate_up (N > 16384; 4 rows of gate and 4 of up a CTA), the lm_head and narrow shapes
    return dict(block_n=4 if n > 16384 and not head else 16, block_k=bk)


def dot_tile(kind: str, n: int, k: int, m: int) -> dict:
    """Keyword arguments for gemv_dot(swap=True) at batch m > 1 (kind "fp8")."""
    override = tile_override(f"{kind}_dot", n, k)
    if override is not None:
        return {"num_stages": 4, **override}
    if k >= 8192:  # down_proj: few row tiles, so K is split, and deep pipelines keep each CTA reading
        return dict(block_n=64, block_k=128, num_warps=4, num_stages=8, split_k=3)
    if k >= 4096:  # out_proj / o_proj
        return dict(block_n=64, block_k=256, num_warps=4, num_stages=6, split_k=1)
    # the input projections and the lm_head (K = 2560): enough row tiles unsplit
    return dict(block_n=64, block_k=256, num_warps=4, num_stages=3, split_k=1) if m <= 32 else \
        dict(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=1)


def tile_override_name(kind: str, n: int, k: int) -> str:
    """The environment variable that overrides the tile of one shape and kind."""
    return f"OCRIAQUANT_TILE_{kind}_{n}x{k}"


def tile_override(kind: str, n: int, k: int) -> dict | None:
    """The tile OCRIAQUANT_TILE_<kind>_<n>x<k> asks for, or None when it is unset."""
    name = tile_override_name(kind, n, k)
    value = os.environ.get(name)
    if not value:
        return None
    try:
        v = [int(t) for t in value.split(",")]
    except ValueError:
        v = []
    lengths = (3,) if kind == "nvfp4_silu" else (3, 4, 5) if kind.endswith("_dot") or kind == "nvfp4" else (3, 4)
    if len(v) not in lengths or min(v) <= 0 or any(t & (t - 1) for t in v[:3]):
        raise ValueError(f"{name}={value!r}: expected 'block_n,block_k,num_warps[,split_k]' (no split_k for "
                         "nvfp4_silu; fp8_dot also takes ',num_stages' after split_k, nvfp4 ',maxnreg'), "
                         "positive integers, the first three powers of two (e.g. 128,512,8,8); unset it to use the "
                         "built-in rule")
    fifth = "num_stages" if kind.endswith("_dot") else "maxnreg"
    return dict(block_n=v[0], block_k=v[1], num_warps=v[2], **({"split_k": v[3]} if len(v) >= 4 else {}),
                **({fifth: v[4]} if len(v) == 5 else {}))
