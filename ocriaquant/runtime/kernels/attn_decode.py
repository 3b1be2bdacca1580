"""Decode attention over the static per-slot KV cache: one new query token per batch row,
split along the sequence (flash-decoding), GQA, no gather.

The torch path gathers each row's cache prefix (`k[slots, :, :span]`) and needs `span` =
max(lengths) + 1 on the host: a copy of every visible key and value each step, and a host
sync that a CUDA graph cannot hold. Here every (row, KV head, chunk of CHUNK positions) is one
program reading its slot's cache in place; the grid depends only on max_len, so one launch
shape serves every step and the decode step can be captured. A chunk past the row's length
does no work. A second launch merges the chunks' partial softmaxes (max, sum, weighted values).

With `quant="fp8"` (an FP8 o_proj) the merge also quantizes each row's output per token, as
quant_fp8_per_token does: the row's last head to finish (a ticket per row, as in splitk.py)
quantizes the whole row.

Layouts: q [B, heads, hd]; cache [slots, KV heads, max_len, hd] (hd contiguous); slots and
lengths int32 [B] — `lengths[b]` is the position of the new token, already written to the
cache, so positions 0..lengths[b] are visible. Padded rows point at a sentinel slot with
length 0: they read one position of it and their output is ignored.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .gemv_fp8 import quant_fp8_row_when_last
from .qk_norm_rope import norm_rope_rows
from .rounding import round_bf16
from .splitk import prefetch_l2, start_after_producer, use_pdl, workspace

CHUNK = 256  # positions per program above batch 1 (CHUNK_B1 below)
CHUNK_WARPS = 4  # warps per chunk program
KEY_TILE = 64  # keys a chunk program scores at a time (32 under the interpreter, for speed)
MERGE_WARPS = 4  # warps per merge program (it holds a [splits, head dim] fp32 tile)
# At batch 1 the grid is only (KV heads × chunks): shorter chunks give more programs, each with a shorter serial
# chain of key tiles. Mixed plan's batch-1 step on an H200 at bench's cache length (max_len 5092, context 512):
# 1.769 ms at 256, 1.705-1.710 at 128; BF16 2.660 -> 2.646 (scripts/ab_step.py, BENCHMARKS.md, session 19). At
# batch 64 the same 128 cost 0.12 ms (most chunks lie past the rows' lengths), so it is batch 1's alone. 64 was
# equal at context 512 (1.707) and slower at 4096 (1.737 against 1.711).
CHUNK_B1 = 128
MERGE_WARPS_B1 = 4  # MERGE_WARPS at batch 1 (8: equal at CHUNK_B1 128)
# At batch 1 attention is one launch, attn_decode_fused, in place of qk_norm_rope + chunks + merge (fused_at).
FUSED_B1 = 1
FUSED_CHUNK_B1 = 128  # attn_decode_fused's positions per program
MERGE_SPLITS = 8  # chunks attn_decode_fused's merge reads at a time, for all of a KV group's heads
# attn_decode_fused's keys a step and warps. Compiled for sm_90 (Triton 3.9) at the 4B's head dim 256: 64 keys on 4
# warps spill (255 registers, 480-byte stack; the chunk kernel alone spills too, 296 bytes), 32 keys do not (254).
FUSED_KEY_TILE = 32
FUSED_WARPS = 4
FUSED_PREFETCH = 1  # ask L2 for the chunk's cached keys and values before the PDL wait


@triton.jit
def _chunk_softmax(q, k_ptr, v_ptr, base, start, end, c_stride_t, scale, GP: tl.constexpr, HD: tl.constexpr,
                   BT: tl.constexpr, INTERPRET: tl.constexpr):
    """Queries q [GP, HD] over cache positions start … end-1 at base (one slot's KV head): the
    chunk's running max, sum and weighted values, fp32 ([GP], [GP], [GP, HD])."""
    rt = tl.arange(0, BT)
    rd = tl.arange(0, HD)
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, HD), tl.float32)
    for t0 in range(start, end, BT):
        t = t0 + rt
        tmask = t < end
        offs = base + t[:, None] * c_stride_t + rd[None, :]
        k = tl.load(k_ptr + offs, mask=tmask[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=tmask[:, None], other=0.0)
        if INTERPRET:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if INTERPRET:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        else:  # P in the cache dtype for the tensor cores, as flash attention does
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _merge_heads(po_ptr, pm_ptr, pl_ptr, out_ptr, g_ptr, qs_ptr, b, h0, n, NSPLIT, HEADS, stride_ob, stride_oh,
                 stride_gb, stride_gh, G, HD: tl.constexpr, GM: tl.constexpr, SB: tl.constexpr, GATED: tl.constexpr,
                 AMAX: tl.constexpr):
    """Heads h0 … h0+G-1 of row b (GM ≥ G, a power of two) from their first n chunks' partials:
    the softmax-weighted sum, times sigmoid(gate) (GATED), stored in out's dtype; AMAX: each
    head's max |out| at qs[b, h]. SB chunks at a time, merged online (a running max, as flash
    attention does): with SB ≥ n one pass, every load in one round trip. The partials are read
    from L2 (.cg): in attn_decode_fused other programs of the grid wrote them."""
    rh = tl.arange(0, GM)
    rd = tl.arange(0, HD)
    hmask = rh < G
    if GATED:  # issued first, to share the partials' round trip
        gate = tl.load(g_ptr + b * stride_gb + (h0 + rh)[:, None] * stride_gh + rd[None, :], mask=hmask[:, None],
                       other=0.0).to(tl.float32)
    base = (b * HEADS + h0 + rh) * NSPLIT
    m_run = tl.full((GM,), float("-inf"), tl.float32)
    l_run = tl.zeros((GM,), tl.float32)
    o = tl.zeros((GM, HD), tl.float32)
    for s0 in range(0, n, SB):
        rb = s0 + tl.arange(0, SB)
        msk = hmask[:, None] & (rb < n)[None, :]
        idx = base[:, None] + rb[None, :]
        m = tl.load(pm_ptr + idx, mask=msk, other=float("-inf"), cache_modifier=".cg")
        lp = tl.load(pl_ptr + idx, mask=msk, other=0.0, cache_modifier=".cg")
        op = tl.load(po_ptr + idx[:, :, None] * HD + rd[None, None, :], mask=msk[:, :, None], other=0.0,
                     cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, 1))  # finite: chunk 0, in the first pass, holds position 0
        alpha = tl.exp(m_run - m_new)
        w = tl.where(m > float("-inf"), tl.exp(m - m_new[:, None]), 0.0)
        l_run = l_run * alpha + tl.sum(w * lp, 1)
        o = o * alpha[:, None] + tl.sum(op * w[:, :, None], 1)
        m_run = m_new
    o = o / l_run[:, None]
    if GATED:  # Qwen3.5's output gate, o · sigmoid(gate), each rounded to bf16 as torch does
        o = round_bf16(round_bf16(o) * round_bf16(1.0 / (1.0 + tl.exp(-gate))))
    o = o.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * stride_ob + (h0 + rh)[:, None] * stride_oh + rd[None, :], o, mask=hmask[:, None])
    if AMAX:  # each head's part of the row's absmax (gemv_fp8_quantizing), of the values as stored
        tl.store(qs_ptr + b * HEADS + h0 + rh, tl.max(tl.abs(o.to(tl.float32)), 1), mask=hmask)


@triton.jit
def _attn_chunk_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, po_ptr, pm_ptr, pl_ptr, stride_qb, stride_qh,
                       c_stride_slot, c_stride_h, c_stride_t, scale, NSPLIT, G: tl.constexpr, GP: tl.constexpr,
                       HD: tl.constexpr, BT: tl.constexpr, CHUNK_: tl.constexpr, INTERPRET: tl.constexpr,
                       PDL: tl.constexpr):
    start_after_producer(PDL)  # q and the new token's k/v come from qk_norm_rope
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    last = tl.load(len_ptr + b)
    rg = tl.arange(0, GP)
    rd = tl.arange(0, HD)
    gmask = rg < G
    q = tl.load(q_ptr + b * stride_qb + (kvh * G + rg)[:, None] * stride_qh + rd[None, :], mask=gmask[:, None],
                other=0.0)
    if INTERPRET:  # the interpreter's tl.dot is only trusted in fp32 (rounding.py)
        q = q.to(tl.float32)
    base = slot * c_stride_slot + kvh * c_stride_h
    start = sp * CHUNK_
    m_i, l_i, acc = _chunk_softmax(q, k_ptr, v_ptr, base, start, tl.minimum(start + CHUNK_, last + 1), c_stride_t,
                                   scale, GP, HD, BT, INTERPRET)
    pidx = (b * tl.num_programs(1) * G + kvh * G + rg) * NSPLIT + sp  # partials are [B, heads, NSPLIT]
    tl.store(pm_ptr + pidx, m_i, mask=gmask)
    tl.store(pl_ptr + pidx, l_i, mask=gmask)
    tl.store(po_ptr + pidx[:, None] * HD + rd[None, :], acc, mask=gmask[:, None])


@triton.jit
def _attn_merge_kernel(po_ptr, pm_ptr, pl_ptr, out_ptr, g_ptr, q8_ptr, qs_ptr, tick_ptr, stride_ob, stride_oh,
                       stride_gb, stride_gh, NSPLIT, HEADS, HD: tl.constexpr, SP: tl.constexpr, GATED: tl.constexpr,
                       PDL: tl.constexpr, QUANT: tl.constexpr, QB: tl.constexpr):
    start_after_producer(PDL)  # the next GEMV streams weights; this waits for its own inputs
    b = tl.program_id(0)
    h = tl.program_id(1)
    _merge_heads(po_ptr, pm_ptr, pl_ptr, out_ptr, g_ptr, qs_ptr, b, h, NSPLIT, NSPLIT, HEADS, stride_ob, stride_oh,
                 stride_gb, stride_gh, 1, HD, 1, SP, GATED, QUANT == 2)
    if QUANT == 1:  # the row's last head quantizes the row
        quant_fp8_row_when_last(tick_ptr + b, HEADS, out_ptr + b * stride_ob, q8_ptr + b * HEADS * HD, qs_ptr + b,
                                qs_ptr, HEADS * HD, QB, False)


@triton.jit
def _attn_fused_kernel(qg_ptr, kn_ptr, vn_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slot_ptr, len_ptr,
                       po_ptr, pm_ptr, pl_ptr, tick_ptr, out_ptr, qs_ptr, stride_qb, stride_qh, stride_kb, stride_vb,
                       stride_cb, c_stride_slot, c_stride_h, c_stride_t, stride_ob, stride_oh, scale, eps, NSPLIT,
                       HEADS, ROT, G: tl.constexpr, GP: tl.constexpr, GM: tl.constexpr, HD: tl.constexpr,
                       BT: tl.constexpr, CHUNK_: tl.constexpr, MERGE_SPLITS: tl.constexpr, LINE: tl.constexpr,
                       AMAX: tl.constexpr, PREFETCH: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    """Program (row, KV head, chunk) of attn_decode_fused. Chunks past the row's length exit at
    once; the rest ask L2 for their cached keys and values before the PDL wait (positions before
    the new token are from earlier steps, and the slot and length from step_inputs, long done),
    norm and rotate their G query heads themselves, and the chunk holding the new token makes
    its k (normed, rotated) and v, writes them to the cache and scores them from registers. The
    last chunk of a (row, KV head) to finish, by an acq_rel ticket as in splitk.store_or_reduce,
    merges the G heads."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    last = tl.load(len_ptr + b)
    live = last // CHUNK_ + 1  # chunks holding a visible position
    if sp < live:
        base = slot * c_stride_slot + kvh * c_stride_h
        start = sp * CHUNK_
        end = tl.minimum(start + CHUNK_, last + 1)
        if PREFETCH:  # one request per 128-byte line of the chunk's rows, clamped inside the chunk
            t = tl.minimum(start + tl.arange(0, CHUNK_), end - 1)
            lines = base + t[:, None] * c_stride_t + (tl.arange(0, (HD + LINE - 1) // LINE) * LINE)[None, :]
            prefetch_l2(k_ptr + lines)
            prefetch_l2(v_ptr + lines)
        start_after_producer(PDL)  # q, k, v come from the qkv GEMV
        rg = tl.arange(0, GP)
        rd = tl.arange(0, HD)
        gmask = rg < G
        cos = cos_ptr + b * stride_cb
        sin = sin_ptr + b * stride_cb
        q = norm_rope_rows(qg_ptr + b * stride_qb + (kvh * G + rg) * stride_qh, gmask, qw_ptr, cos, sin, eps, HD, ROT,
                           HD)
        # the new token's k (normed, rotated) and v, in the same round trip as q: the chunk holding it writes
        # them to the cache and scores them from registers (every program loads them: 1 KB, no branch to join)
        one = tl.arange(0, 1)
        kn = norm_rope_rows(kn_ptr + b * stride_kb + kvh * HD + one, one < 1, kw_ptr, cos, sin, eps, HD, ROT, HD)
        vn = tl.load(vn_ptr + b * stride_vb + kvh * HD + rd)
        newest = sp == live - 1
        if newest:
            dst = base + last.to(tl.int64) * c_stride_t + rd
            tl.store(k_ptr + dst[None, :], kn.to(k_ptr.dtype.element_ty))
            tl.store(v_ptr + dst, vn)
            end = last  # the loop reads the positions before it
        s_new = tl.sum(q * kn, 1) * scale  # the new token's scores, here: q's fp32 copy need not outlive the loop
        if not INTERPRET:  # the interpreter's tl.dot is only trusted in fp32 (rounding.py); q's values are bf16
            q = q.to(k_ptr.dtype.element_ty)
        m_i, l_i, acc = _chunk_softmax(q, k_ptr, v_ptr, base, start, end, c_stride_t, scale, GP, HD, BT, INTERPRET)
        if newest:  # and the new token from registers: no store and read-back through the cache on this path
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp(m_i - m_new)
            p_new = tl.exp(s_new - m_new)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * vn.to(tl.float32)[None, :]
            m_i = m_new
        pidx = (b * HEADS + kvh * G + rg) * NSPLIT + sp  # partials are [B, heads, NSPLIT]
        tl.store(pm_ptr + pidx, m_i, mask=gmask)
        tl.store(pl_ptr + pidx, l_i, mask=gmask)
        tl.store(po_ptr + pidx[:, None] * HD + rd[None, :], acc, mask=gmask[:, None])
        tl.debug_barrier()
        ticket = tl.atomic_add(tick_ptr + b * tl.num_programs(1) + kvh, 1, sem="acq_rel")
        tl.debug_barrier()
        if ticket == live - 1:  # the group's heads at once: one round trip for all their partials
            _merge_heads(po_ptr, pm_ptr, pl_ptr, out_ptr, qg_ptr + HD, qs_ptr, b, kvh * G, live, NSPLIT, HEADS,
                         stride_ob, stride_oh, stride_qb, stride_qh, G, HD, GM, MERGE_SPLITS, True, AMAX)
            tl.atomic_xchg(tick_ptr + b * tl.num_programs(1) + kvh, 0)


def attn_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                lengths: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                gate: torch.Tensor | None = None, quant: str | None = None):
    """q [B, heads, hd]; k/v cache [slots, KV heads, max_len, hd]; slots, lengths int32 [B]
    -> [B, heads, hd] in q's dtype: softmax(q·kᵀ·scale) v over positions 0..lengths[b], times
    sigmoid(gate) when `gate` [B, heads, hd] (strides free, hd contiguous) is given.
    quant="fp8": returns (out, (E4M3 [B, heads·hd], fp32 scale [B, 1])), each row quantized as
    quant_fp8_per_token does, in the merge launch. quant="amax": returns (out, (fp32 [B, heads],)),
    each head's max |out|: the row's absmax in parts, for gemv_fp8_quantizing (batch 1)."""
    bsz, heads, hd = q.shape
    _, kvh, max_len, hd_c = k_cache.shape
    if hd_c != hd or heads % kvh or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError(f"attn_decode: q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)} "
                         "(head dim, GQA groups, contiguous head dim, same k/v strides)")
    if q.stride(2) != 1:
        q = q.contiguous()
    g = heads // kvh
    chunk, merge_warps = (CHUNK_B1, MERGE_WARPS_B1) if bsz == 1 else (CHUNK, MERGE_WARPS)
    nsplit = triton.cdiv(max_len, chunk)
    dev = q.device
    po = torch.empty(bsz, heads, nsplit, hd, dtype=torch.float32, device=dev)
    pm = torch.empty(bsz, heads, nsplit, dtype=torch.float32, device=dev)
    pl = torch.empty(bsz, heads, nsplit, dtype=torch.float32, device=dev)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    pdl = use_pdl(dev, None)
    _attn_chunk_kernel[(bsz, kvh, nsplit)](
        q, k_cache, v_cache, slots, lengths, po, pm, pl, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), scale, nsplit, G=g, GP=max(16, triton.next_power_of_2(g)), HD=hd,
        BT=32 if interp else KEY_TILE, CHUNK_=chunk, INTERPRET=interp, num_warps=CHUNK_WARPS, PDL=pdl, launch_pdl=pdl)
    out = torch.empty(bsz, heads, hd, dtype=q.dtype, device=dev) if out is None else out
    if gate is not None and (gate.shape != q.shape or gate.stride(2) != 1):
        raise ValueError(f"attn_decode: gate {tuple(gate.shape)} must be shaped like q {tuple(q.shape)}, hd contiguous")
    g = gate if gate is not None else out
    if quant not in (None, "fp8", "amax") or (quant and out.stride(0) != heads * hd):
        raise ValueError(f"attn_decode: quant must be None, 'fp8' or 'amax' (with contiguous output rows), "
                         f"got {quant!r}")
    q8 = qs = tick = out
    if quant == "amax":
        qs = torch.empty(bsz, heads, dtype=torch.float32, device=dev)
    if quant == "fp8":
        q8 = torch.empty(bsz, heads * hd, dtype=torch.float8_e4m3fn, device=dev)
        qs = torch.empty(bsz, 1, dtype=torch.float32, device=dev)
        _, tick = workspace(dev, (1,), bsz, owner="attn_quant")
    _attn_merge_kernel[(bsz, heads)](po, pm, pl, out, g, q8.view(torch.uint8) if quant == "fp8" else q8, qs, tick,
                                     out.stride(0), out.stride(1), g.stride(0), g.stride(1), nsplit, heads, HD=hd,
                                     SP=triton.next_power_of_2(nsplit), GATED=gate is not None, num_warps=merge_warps,
                                     PDL=pdl, launch_pdl=pdl, QUANT={None: 0, "fp8": 1, "amax": 2}[quant],
                                     QB=min(4096, triton.next_power_of_2(heads * hd)))
    if quant == "amax":  # a 1-tuple, like the other forms a Linear's x_q takes
        return out, (qs,)
    return out if quant is None else (out, (q8, qs))


def fused_at(batch: int, quant: str | None) -> bool:
    """Whether Attention.decode runs attn_decode_fused (one launch) rather than qk_norm_rope and
    attn_decode (three): at batch 1, unless the row must be quantized whole (quant="fp8"). Read
    at every call, so scripts/ab_step.py can switch FUSED_B1."""
    return bool(FUSED_B1) and batch == 1 and quant != "fp8"


def attn_decode_fused(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                      scale: float, quant: str | None = None, chunk: int | None = None,
                      out: torch.Tensor | None = None):
    """qk_norm_rope, then attn_decode with the output gate, in one launch: qg [B, heads, 2·hd]
    (per head its q, then its gate: q_proj's output), k, v [B, KV heads · hd] (row strides free),
    the rest as those two take them. Writes the new k and v into the cache and returns
    out [B, heads, hd], or with quant="amax" (out, (fp32 [B, heads],)) as attn_decode does.
    chunk: positions per program (default FUSED_CHUNK_B1); out: where to write (contiguous)."""
    bsz, heads, hd2 = qg.shape
    hd = hd2 // 2
    _, kvh, max_len, hd_c = k_cache.shape
    rot = cos.shape[-1]
    if (hd_c != hd or heads % kvh or qg.stride(2) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1
            or k.shape[-1] != kvh * hd or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride()
            or rot > hd or rot % 2 or cos.stride(-1) != 1 or cos.stride() != sin.stride()):
        raise ValueError(f"attn_decode_fused: qg {tuple(qg.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} do "
                         f"not fit the cache {tuple(k_cache.shape)}")
    if quant not in (None, "amax"):
        raise ValueError(f"attn_decode_fused: quant must be None or 'amax', got {quant!r}")
    chunk = chunk or FUSED_CHUNK_B1
    nsplit = triton.cdiv(max_len, chunk)
    dev = qg.device
    po = torch.empty(bsz, heads, nsplit, hd, dtype=torch.float32, device=dev)
    pm = torch.empty(bsz, heads, nsplit, dtype=torch.float32, device=dev)
    pl = torch.empty(bsz, heads, nsplit, dtype=torch.float32, device=dev)
    _, tick = workspace(dev, (1,), bsz * kvh, owner="attn_fused")
    out = torch.empty(bsz, heads, hd, dtype=qg.dtype, device=dev) if out is None else out
    if out.shape != (bsz, heads, hd) or not out.is_contiguous():
        raise ValueError(f"attn_decode_fused: out must be contiguous [{bsz}, {heads}, {hd}], got {tuple(out.shape)}")
    qs = torch.empty(bsz, heads, dtype=torch.float32, device=dev) if quant == "amax" else out
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    pdl = use_pdl(dev, None)
    g = heads // kvh
    _attn_fused_kernel[(bsz, kvh, nsplit)](
        qg, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, slots, lengths, po, pm, pl, tick, out, qs,
        qg.stride(0), qg.stride(1), k.stride(0), v.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), out.stride(0), out.stride(1), scale, eps, nsplit, heads, rot, G=g,
        GP=max(16, triton.next_power_of_2(g)), GM=triton.next_power_of_2(g), HD=hd, BT=32 if interp else FUSED_KEY_TILE,
        CHUNK_=chunk, MERGE_SPLITS=min(MERGE_SPLITS, triton.next_power_of_2(nsplit)),
        LINE=128 // k_cache.element_size(), AMAX=quant == "amax",
        PREFETCH=bool(FUSED_PREFETCH) and not interp, INTERPRET=interp, num_warps=FUSED_WARPS, PDL=pdl, launch_pdl=pdl)
    return (out, (qs,)) if quant == "amax" else out


def attn_decode_ref(q, k_cache, v_cache, slots, lengths, scale, dtype=torch.float64, gate=None):
    """Plain torch, row by row in `dtype`: softmax over the visible prefix of the row's slot,
    times sigmoid(gate) if given."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    g = q.shape[1] // k_cache.shape[1]
    for i, (s, n) in enumerate(zip(slots.tolist(), lengths.tolist())):
        k = k_cache[s, :, : n + 1].to(dtype).repeat_interleave(g, 0)  # [heads, n+1, hd]
        v = v_cache[s, :, : n + 1].to(dtype).repeat_interleave(g, 0)
        p = torch.softmax(torch.einsum("hd,htd->ht", q[i].to(dtype), k) * scale, -1)
        out[i] = torch.einsum("ht,htd->hd", p, v)
    return out if gate is None else out * torch.sigmoid(gate.to(dtype))
