"""FP8 W8A8 weight-streaming GEMV for decode (M = 1…64): y = (x_q · x_scale) @ (W_q · w_scale)ᵀ.

Layouts are the compressed-tensors FP8_DYNAMIC ones export writes: W_q E4M3 [N, K], w_scale
[N, 1] (per output channel); activations are E4M3 per token with an fp32 scale [M, 1]
(`quant_fp8_per_token`, `add_rmsnorm`, or `silu_mul_quant` in the MLP). M = 1 runs on CUDA
cores, two weights per instruction as fp16 pairs (half2.py; gemv_m1.py's fp32 path remains as
`path="fma"` and for K not a multiple of 16), larger M on the FP8 tensor cores (gemv_dot.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv_dot import gemv_dot
from .gemv_m1 import gemv_m1
from .half2 import fp8_pairs, fp8_quad_dot, load_pairs, load_pairs_v4
from .partials import Partials
from .rounding import fp8_token_codes, fp8_token_scale
from .splitk import (interpreted, l2_ahead, launch_plan, partials_view, prefetch_ahead, split_tile,
                     start_after_producer, store_row, use_pdl, wait_for_inputs, whole_tile_mask, workspace)

# K-tiles past its first that a batch-1 CTA asks L2 for before its PDL wait (splitk.prefetch_ahead): only the
# first tile's loads are otherwise in flight across the wait. 1 measured faster than none; 2 was not.
M1_L2_AHEAD = 1
# gemv_fp8's tile above batch 1 when the caller gives none (the runtime always passes its own): 64 weight
# rows a CTA on one warpgroup, 256-wide K-steps on a 3-stage pipeline, the split chosen by splitk.geometry.
DOT_TILE = dict(block_n=64, block_k=256, num_warps=4, num_stages=3)
# gemv_fp8's tile at batch 1 when the caller gives none.
M1_TILE = dict(block_n=16, block_k=256, num_warps=4, num_stages=4)


@triton.jit
def _load_quads(w_ptr, rn, stride_wn, q0, nmask, q_end, BN: tl.constexpr, NQ: tl.constexpr, WHOLE: tl.constexpr,
                EVEN_N: tl.constexpr = False):
    """Words 4q … 4q+3 of quads q0 … q0+NQ-1 (< q_end) of rows rn, as four [BN, NQ] tensors. Loaded as
    one [BN, 4·NQ] tile (one 16-byte load per thread and quad) and split in registers: four
    strided 4-byte loads instead read each sector four times. WHOLE: the split's K range is whole
    tiles and this tile lies inside it (the kernel peels the last one), so only N can mask, with a
    mask constant along K (splitk.whole_tile_mask: 16-byte loads under Triton 3.6); with EVEN_N
    too, no mask at all, and no zero-fill of the destination registers before each load."""
    rw = tl.arange(0, 4 * NQ)
    w_ptrs = w_ptr + rn[:, None] * stride_wn + 4 * q0 + rw[None, :]
    if WHOLE and EVEN_N:
        v = tl.load(w_ptrs, eviction_policy="evict_first")
    elif WHOLE:
        v = tl.load(w_ptrs, mask=whole_tile_mask(nmask, rw, q0, q_end), other=0, eviction_policy="evict_first")
    else:
        wmask = nmask[:, None] & (q0 + tl.arange(0, NQ) < q_end)[None, :]
        vmask = tl.reshape(tl.broadcast_to(wmask[:, :, None], (BN, NQ, 4)), (BN, 4 * NQ))
        v = tl.load(w_ptrs, mask=vmask, other=0, eviction_policy="evict_first")
    even, odd = tl.split(tl.reshape(v, (BN, NQ, 2, 2)))
    v0, v2 = tl.split(even)
    v1, v3 = tl.split(odd)
    return v0, v1, v2, v3


@triton.jit
def _quads_acc(acc, v0, v1, v2, v3, q0, q_end, xh_ptr, NQ: tl.constexpr, INTERPRET: tl.constexpr, V4: tl.constexpr):
    """acc + one tile's quad sums (words v0..v3 of quads q0 …) against the activation pairs."""
    kq = q0 + tl.arange(0, NQ)                               # quad index along K
    if V4:  # whole tiles, 16-byte aligned pairs, GPU: each quad's eight words in two 16-byte loads
        p0, p1, p2, p3, p4, p5, p6, p7 = load_pairs_v4(xh_ptr + kq * 8)
    else:
        p0, p1, p2, p3, p4, p5, p6, p7 = load_pairs(xh_ptr + kq * 8, kq < q_end)
    return acc + fp8_quad_dot(v0, v1, v2, v3, p0, p1, p2, p3, p4, p5, p6, p7, not INTERPRET)


@triton.jit
def _quantize_slice(x_ptr, amax_ptr, n_parts, px_ptr, k_start, k_end, NP: tl.constexpr, BQ: tl.constexpr):
    """QX's prologue: the row's FP8 scale from its producer's partial absmaxes, then this CTA's
    K-slice of the bf16 row as the fp16 pairs the loop reads (fp8_pairs of the codes, exactly what
    quant_fp8_per_token writes), into the CTA's own scratch at px_ptr. Returns the scale."""
    rp = tl.arange(0, NP)
    scale = fp8_token_scale(tl.max(tl.load(amax_ptr + rp, mask=rp < n_parts, other=0.0), 0))
    rq = tl.arange(0, BQ)
    for k0 in range(k_start, k_end, BQ):
        m = k0 + rq < k_end
        codes = fp8_token_codes(tl.load(x_ptr + k0 + rq, mask=m, other=0.0).to(tl.float32), scale)
        tl.store(px_ptr + (k0 - k_start) + rq, fp8_pairs(codes), mask=m)
    tl.debug_barrier()  # the stores of every thread before any of the loop's loads (CTA scope)
    return scale


@triton.jit
def _gemv_fp8_m1_kernel(xh_ptr, xs_ptr, w_ptr, wsc_ptr, y_ptr, ws_ptr, tick_ptr, N, K, stride_wn, K_PER_SPLIT,
                        x_ptr, amax_ptr, px_ptr, n_parts,
                        BN: tl.constexpr, NQ: tl.constexpr, SPLIT_K: tl.constexpr, INTERPRET: tl.constexpr,
                        PDL: tl.constexpr, PARTIALS: tl.constexpr, WHOLE: tl.constexpr, V4: tl.constexpr,
                        EVEN_N: tl.constexpr, QX: tl.constexpr, NP: tl.constexpr, BQ: tl.constexpr,
                        EARLY: tl.constexpr, AHEAD: tl.constexpr = 0):
    """M = 1 on CUDA cores: a tile is BN rows × NQ quads of 16 weights (four 32-bit words);
    two E4M3 weights become an fp16 pair in one cvt and meet two activations in one
    fma.rn.f16x2 (half2.py); each quad's sum goes to fp32, the scales multiply the row's total.
    The activations arrive as fp16 pairs (half2.fp8_pairs: codes × 2^-8, xh int32 [K/2]); with QX
    as the bf16 row x and its absmax in n_parts parts, quantized here (_quantize_slice), each CTA
    its own K-slice, into a scratch of K_PER_SPLIT fp16 per CTA at px_ptr."""
    pid_n, pid_k, rn, nmask, k_start, k_end = split_tile(N, K, K_PER_SPLIT, BN)
    acc = tl.zeros((BN, NQ), dtype=tl.float32)
    q_end = k_end // 16
    q_first = k_start // 16
    if WHOLE:  # splits start on a whole K-tile (16-byte aligned rows: see the launch)
        q_first = tl.multiple_of(q_first, NQ)
    v0, v1, v2, v3 = _load_quads(w_ptr, rn, stride_wn, q_first, nmask, q_end, BN, NQ, WHOLE, EVEN_N)
    if EARLY:  # where it measured faster (early_scales)
        wsc = tl.load(wsc_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    prefetch_ahead(w_ptr, rn, N, stride_wn, 4 * (q_first + NQ), 4 * q_end, AHEAD, 4 * NQ, 32)
    wait_for_inputs(PDL)
    if EARLY and not QX:
        xs = tl.load(xs_ptr)
    if QX:  # the scratch, addressed like xh from the slice's first value on
        px = px_ptr + (pid_n * SPLIT_K + pid_k) * K_PER_SPLIT
        xs = _quantize_slice(x_ptr, amax_ptr, n_parts, px, k_start, k_end, NP, BQ)
        xh_ptr = (px - k_start).to(tl.pointer_type(tl.int32), bitcast=True)
    # The next tile's loads go out before this one is computed: latency bounds these shapes. The
    # last tile is peeled, so with whole tiles the loop's loads are always in range along K: no K
    # mask, no zero-fill (fewer instructions in the loop). Otherwise the last tile may be partial.
    if WHOLE:
        q_last = q_end - NQ
    else:
        q_last = q_first + (q_end - 1 - q_first) // NQ * NQ
    for q0 in range(q_first, q_last, NQ):
        n0, n1, n2, n3 = _load_quads(w_ptr, rn, stride_wn, q0 + NQ, nmask, q_end, BN, NQ, WHOLE, EVEN_N)
        acc = _quads_acc(acc, v0, v1, v2, v3, q0, q_end, xh_ptr, NQ, INTERPRET, V4)
        v0, v1, v2, v3 = n0, n1, n2, n3
    acc = _quads_acc(acc, v0, v1, v2, v3, q_last, q_end, xh_ptr, NQ, INTERPRET, V4)
    if not EARLY:
        if not QX:
            xs = tl.load(xs_ptr)
        wsc = tl.load(wsc_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    y = tl.sum(acc, 1) * (256.0 * xs) * wsc
    store_row(y, y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, N, BN, SPLIT_K, PARTIALS, INTERPRET)


def early_scales(qx: bool, splits: int, num_warps: int) -> bool:
    """Whether the batch-1 kernel loads its scales before the K loop rather than after it: before
    measured faster on the quantizing form and on unsplit 8-warp tiles (the GDN and attention input
    projections), slower on the rest (the compiled loops differ; the cause is not known)."""
    return qx or (splits == 1 and num_warps == 8)


def _gemv_fp8_m1(x_q, x_scale, w_q, w_scale, out, block_n, block_k, split_k, num_warps, num_stages, pdl, x_half,
                 partials=False, x_row=None, x_amax=None):
    """The batch-1 launch: from x_q's codes (x_half: their pairs, if the producer wrote them), or,
    with x_row, from the bf16 row and its absmax parts x_amax (QX: quantized in the kernel)."""
    n, k = w_q.shape
    dev = w_q.device
    _, grid, k_per, out, ws, tick = launch_plan(1, n, k, block_n, block_k, dev, split_k, out)
    partials = partials and grid[1] > 1
    pdl = use_pdl(dev, pdl)
    qx = x_row is not None
    if qx:  # scratch for each CTA's pairs (fp16), reused like the split-K workspace
        px = workspace(dev, (grid[0] * grid[1] * k_per // 2,), 1, owner="gemv_fp8_qx")[0].view(torch.float16)
        x_half, x_scale = px, x_amax
    elif x_half is None:  # E4M3 -> fp16 is exact, and so is the power of two
        x_half = x_q.to(torch.float16) * 0.00390625
    interp = interpreted()
    whole = k % block_k == 0  # every split is whole K-tiles (launch_plan): no K mask, 16-byte loads
    _gemv_fp8_m1_kernel[grid](x_half.view(torch.int32), x_scale.reshape(-1).float(),
                              w_q.view(torch.int32), w_scale.reshape(-1), out, ws, tick, n, k, w_q.stride(0) // 4,
                              k_per, x_row if qx else out, x_amax.reshape(-1) if qx else ws, x_half,
                              x_amax.numel() if qx else 0, BN=block_n,
                              NQ=block_k // 16, SPLIT_K=grid[1], INTERPRET=interp,
                              num_warps=num_warps, num_stages=num_stages, PARTIALS=partials,
                              WHOLE=whole, V4=whole and x_half.data_ptr() % 16 == 0 and not interp,
                              EVEN_N=n % block_n == 0, QX=qx,
                              NP=triton.next_power_of_2(x_amax.numel()) if qx else 1,
                              BQ=min(1024, triton.next_power_of_2(k_per)), EARLY=early_scales(qx, grid[1], num_warps),
                              AHEAD=l2_ahead(interp, k_per // block_k - 1, M1_L2_AHEAD), PDL=pdl, launch_pdl=pdl)
    return partials_view(ws, grid[1], n) if partials else out


def gemv_fp8_quantizing(x: torch.Tensor, x_amax: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                        out: torch.Tensor | None = None, block_n: int = 16, block_k: int = 256,
                        split_k: int | None = None, num_warps: int = 4, num_stages: int = 4, pdl: bool | None = None,
                        partials: bool = False) -> torch.Tensor | Partials:
    """Batch 1: gemv_fp8(quant_fp8_per_token(x)) in one launch. x bf16 [1, K]; x_amax fp32, max |x|
    in parts (any shape: the producer's, e.g. gdn_decode(quant="amax")'s per key head), whose max is
    the row's absmax. Each CTA quantizes its own K-slice (the same codes, so the same output, as
    the two launches), so the decode step loses the quantization kernel between gdn_decode and
    out_proj. The rest as gemv_fp8's half2 path."""
    k = x.shape[-1]
    if x.shape != (1, k) or x.stride(-1) != 1 or w_q.shape[1] != k or k % 16 or w_q.stride(0) % 4:
        raise ValueError(f"gemv_fp8_quantizing: x must be one contiguous row of the weight's K, K a multiple of 16, "
                         f"got x {tuple(x.shape)}, w {tuple(w_q.shape)}")
    return _gemv_fp8_m1(None, None, w_q, w_scale, out, block_n, block_k, split_k, num_warps, num_stages, pdl, None,
                        partials, x_row=x, x_amax=x_amax)


def gemv_fp8(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
             out: torch.Tensor | None = None, block_n: int | None = None, block_k: int | None = None,
             split_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
             path: str = "auto", pdl: bool | None = None, x_half: torch.Tensor | None = None,
             partials: bool = False) -> torch.Tensor | Partials:
    """x_q E4M3 [M, K], x_scale fp32 [M, 1], w_q E4M3 [N, K], w_scale [N, 1] -> bf16 [M, N].
    path: "half2" (M = 1, paired fp16 on CUDA cores), "fma" (M = 1, fp32 on CUDA cores:
    gemv_m1.py), "dot" (tensor cores, gemv_dot's swapped form), "auto" (half2 at M = 1 where K
    and the rows allow, dot above). Tile arguments left None: M1_TILE's at M = 1, DOT_TILE's on the
    tensor cores (the runtime passes its own tiles).
    x_half: fp16 [1, K], x_q's values × 2^-8 (half2.fp8_pairs), already written by the
    producer, for the half2 path (None: converted here, one more launch). partials: on the half2
    path, when K is split, return the splits' fp32 sums unreduced (partials.Partials, for
    add_rmsnorm) instead of the bf16 output."""
    m, k = x_q.shape
    n = w_q.shape[0]
    if w_q.shape[1] != k:
        raise ValueError(f"gemv_fp8: x has K={k} but the weight is {tuple(w_q.shape)}")
    if m > 64:
        raise ValueError(f"gemv_fp8 is for decode (M <= 64), got M={m}; use torch._scaled_mm above that")
    half2_ok = k % 16 == 0 and w_q.stride(1) == 1 and w_q.stride(0) % 4 == 0 and w_q.data_ptr() % 4 == 0
    dot = path == "dot" or (path == "auto" and m > 1)
    given = {key: v for key, v in dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                                       num_stages=num_stages).items() if v is not None}
    tile = {**(DOT_TILE if dot else M1_TILE), **given}
    if dot:
        return gemv_dot(x_q, w_q, x_scale, w_scale, out=out, swap=True, pdl=pdl, **tile)
    if path == "half2" or (path == "auto" and half2_ok):
        if m != 1 or not half2_ok:
            raise ValueError(f"gemv_fp8: the half2 path is for M = 1 and K a multiple of 16 with aligned rows, "
                             f"got M={m}, w {tuple(w_q.shape)}")
        return _gemv_fp8_m1(x_q, x_scale, w_q, w_scale, out, tile["block_n"], tile["block_k"], tile.get("split_k"),
                            tile["num_warps"], tile["num_stages"], pdl, x_half, partials)
    tile.pop("num_stages")
    return gemv_m1(x_q, w_q, x_scale, w_scale, out=out, pdl=pdl, **tile)


@triton.jit
def row_absmax(x_ptr, K, BK: tl.constexpr):
    """max |x| over the K values at x_ptr, read from L2 (.cg): quant_fp8_row_when_last calls this
    on a row other programs of its grid wrote."""
    rk = tl.arange(0, BK)
    amax = tl.zeros((BK,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0, cache_modifier=".cg").to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    return tl.max(amax, 0)


@triton.jit
def quant_fp8_span(x_ptr, q_ptr, h_ptr, scale, start, end, BK: tl.constexpr, HALF: tl.constexpr):
    """Values start … end-1 of the row at x_ptr -> their E4M3 codes at q_ptr (and, with HALF,
    the codes' fp16 pairs at h_ptr), at the row's scale."""
    rk = tl.arange(0, BK)
    for k0 in range(start, end, BK):
        m = k0 + rk < end
        codes = fp8_token_codes(tl.load(x_ptr + k0 + rk, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32),
                                scale)
        tl.store(q_ptr + k0 + rk, codes.to(tl.uint8), mask=m)
        if HALF:
            tl.store(h_ptr + k0 + rk, fp8_pairs(codes), mask=m)


@triton.jit
def quant_fp8_row(x_ptr, q_ptr, s_ptr, h_ptr, K, BK: tl.constexpr, HALF: tl.constexpr):
    """One row of K activations at x_ptr -> E4M3 codes at q_ptr, the scale at s_ptr and, with
    HALF, the codes' fp16 pairs at h_ptr, by one program."""
    scale = fp8_token_scale(row_absmax(x_ptr, K, BK))
    quant_fp8_span(x_ptr, q_ptr, h_ptr, scale, 0, K, BK, HALF)
    tl.store(s_ptr, scale)


@triton.jit
def quant_fp8_row_when_last(tick_ptr, parts, x_ptr, q_ptr, s_ptr, h_ptr, K, BK: tl.constexpr, HALF: tl.constexpr):
    """Called by each of the `parts` programs that write a row of x (gdn_decode's key heads,
    attn_decode's heads) after its own stores: the last to arrive quantizes the whole row
    (quant_fp8_row) and resets the row's ticket. A barrier puts every thread's stores before
    the acq_rel ticket, as in splitk.store_or_reduce."""
    tl.debug_barrier()
    ticket = tl.atomic_add(tick_ptr, 1, sem="acq_rel")
    tl.debug_barrier()
    if ticket == parts - 1:
        quant_fp8_row(x_ptr, q_ptr, s_ptr, h_ptr, K, BK, HALF)
        tl.atomic_xchg(tick_ptr, 0)


QUANT_SLICE_M1 = 256  # values per program at batch 1 (quant_fp8_per_token's slice_k)


@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, h_ptr, K, stride_xm, SLICE, BK: tl.constexpr, BS: tl.constexpr,
                      HALF: tl.constexpr, PDL: tl.constexpr):
    """Program (row, slice): the whole row's absmax (BK-wide loads), then the codes of its SLICE
    values only, BS at a time (BS no wider than the slice, so no lane computes a masked-off code)."""
    start_after_producer(PDL)  # the next GEMV streams weights; this waits for its own inputs
    row = tl.program_id(0)
    start = tl.program_id(1) * SLICE
    x = x_ptr + row * stride_xm
    scale = fp8_token_scale(row_absmax(x, K, BK))
    quant_fp8_span(x, q_ptr + row * K, h_ptr + row * K, scale, start, tl.minimum(start + SLICE, K), BS, HALF)
    if tl.program_id(1) == 0:
        tl.store(s_ptr + row, scale)


def quant_fp8_per_token(x: torch.Tensor, half: bool = False, slice_k: int | None = None,
                        pdl: bool | None = None) -> tuple[torch.Tensor, ...]:
    """bf16 [M, K] -> (E4M3 [M, K], fp32 scale [M, 1]), numerics of quant.fp8.fake_quant_activation;
    half: and a third item, the codes' values × 2^-8 in fp16 (half2.fp8_pairs), what
    gemv_fp8's batch-1 kernel reads. slice_k: values a program quantizes, each program also
    reading its row whole for the scale (K or more: one 8-warp program per row). None: slices of
    256 on 2 warps at M = 1, one program per row above. At batch 1 the one-program kernel sat on
    the decode step's critical path between gdn_decode and out_proj; slices share its work out.
    Above batch 1 the runtime quantizes in gdn_decode / attn_decode. pdl: as splitk.use_pdl."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    h = torch.empty(m, k, dtype=torch.float16, device=x.device) if half else s
    pdl = use_pdl(x.device, pdl)
    if slice_k is None:
        slice_k = QUANT_SLICE_M1 if m == 1 else k
    sl = min(slice_k, k)
    bk = min(4096, triton.next_power_of_2(k))
    warps = 8 if sl == k else (2 if sl <= 256 else 4)
    _quant_fp8_kernel[(m, triton.cdiv(k, sl))](x, q.view(torch.uint8), s, h, k, x.stride(0), sl, BK=bk,
                                               BS=min(bk, triton.next_power_of_2(sl)), HALF=half, PDL=pdl,
                                               launch_pdl=pdl, num_warps=warps)
    return (q, s, h) if half else (q, s)
