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

import torch
import triton
import triton.language as tl

from .gemv_fp8 import quant_fp8_row_when_last
from .rounding import round_bf16
from .splitk import interpreted, prefetch_l2, start_after_producer, use_pdl, workspace

CHUNK = 256  # positions per program above batch 1 (CHUNK_B1 below)
CHUNK_WARPS = 4  # warps per chunk program
KEY_TILE = 64  # keys a chunk program scores at a time (32 under the interpreter, for speed)
MERGE_WARPS = 4  # warps per merge program (it holds a [splits, head dim] fp32 tile)
# At batch 1 the grid is only (KV heads × chunks): shorter chunks give more programs, each with a shorter serial
# chain of key tiles (128 measured faster than 256, and than 64 at long contexts). Above batch 1 most chunks lie
# past the rows' lengths, and 128 was slower there, so it is batch 1's alone.
CHUNK_B1 = 128
MERGE_WARPS_B1 = 4  # MERGE_WARPS at batch 1
# Whether a batch-1 chunk program asks L2 for its chunk's cached keys and values (one prefetch per 128-byte line)
# before its PDL wait, while qk_norm_rope and the GEMV before it run: every position but the new token's is from
# earlier steps, and the slot and length come from step_inputs, long finished. GPU only; measured faster at batch 1.
CHUNK_PREFETCH = 1


@triton.jit
def _attn_chunk_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, po_ptr, pm_ptr, pl_ptr, stride_qb, stride_qh,
                       c_stride_slot, c_stride_h, c_stride_t, scale, NSPLIT, G: tl.constexpr, GP: tl.constexpr,
                       HD: tl.constexpr, BT: tl.constexpr, CHUNK_: tl.constexpr, INTERPRET: tl.constexpr,
                       PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    # slot and length come from step_inputs, finished before the kernel this one follows began: safe before the wait
    slot = tl.load(slot_ptr + b).to(tl.int64)
    last = tl.load(len_ptr + b)
    if PREFETCH and sp * CHUNK_ <= last:  # the chunk's cached keys and values asked of L2 (see CHUNK_PREFETCH)
        t = tl.minimum(sp * CHUNK_ + tl.arange(0, CHUNK_), last)
        lines = slot * c_stride_slot + kvh * c_stride_h + t[:, None] * c_stride_t + \
            (tl.arange(0, (HD + LINE - 1) // LINE) * LINE)[None, :]
        prefetch_l2(k_ptr + lines)
        prefetch_l2(v_ptr + lines)
    start_after_producer(PDL)  # q and the new token's k/v come from qk_norm_rope
    rg = tl.arange(0, GP)
    rd = tl.arange(0, HD)
    rt = tl.arange(0, BT)
    gmask = rg < G
    q = tl.load(q_ptr + b * stride_qb + (kvh * G + rg)[:, None] * stride_qh + rd[None, :], mask=gmask[:, None],
                other=0.0)
    if INTERPRET:  # the interpreter's tl.dot is only trusted in fp32 (rounding.py)
        q = q.to(tl.float32)
    base = slot * c_stride_slot + kvh * c_stride_h
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, HD), tl.float32)
    start = sp * CHUNK_
    end = tl.minimum(start + CHUNK_, last + 1)
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
    rs = tl.arange(0, SP)
    rd = tl.arange(0, HD)
    base = (b * HEADS + h) * NSPLIT
    smask = rs < NSPLIT
    m = tl.load(pm_ptr + base + rs, mask=smask, other=float("-inf"))
    mx = tl.max(m, 0)  # chunk 0 always holds position 0, so mx is finite
    w = tl.where(smask & (m > float("-inf")), tl.exp(m - mx), 0.0)
    l = tl.sum(w * tl.load(pl_ptr + base + rs, mask=smask, other=0.0), 0)
    o = tl.load(po_ptr + (base + rs)[:, None] * HD + rd[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(o * w[:, None], 0) / l
    if GATED:  # Qwen3.5's output gate, o · sigmoid(gate), each rounded to bf16 as torch does
        g = tl.load(g_ptr + b * stride_gb + h * stride_gh + rd).to(tl.float32)
        o = round_bf16(round_bf16(o) * round_bf16(1.0 / (1.0 + tl.exp(-g))))
    o = o.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + rd, o)
    if QUANT == 2:  # this head's part of the row's absmax (gemv_fp8_quantizing), of the values as stored
        tl.store(qs_ptr + b * HEADS + h, tl.max(tl.abs(o.to(tl.float32)), 0))
    if QUANT == 1:  # the row's last head quantizes the row
        quant_fp8_row_when_last(tick_ptr + b, HEADS, out_ptr + b * stride_ob, q8_ptr + b * HEADS * HD, qs_ptr + b,
                                qs_ptr, HEADS * HD, QB, False)


def attn_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                lengths: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                gate: torch.Tensor | None = None, quant: str | None = None, pdl: bool | None = None):
    """q [B, heads, hd]; k/v cache [slots, KV heads, max_len, hd]; slots, lengths int32 [B]
    -> [B, heads, hd] in q's dtype: softmax(q·kᵀ·scale) v over positions 0..lengths[b], times
    sigmoid(gate) when `gate` [B, heads, hd] (strides free, hd contiguous) is given.
    quant="fp8": returns (out, (E4M3 [B, heads·hd], fp32 scale [B, 1])), each row quantized as
    quant_fp8_per_token does, in the merge launch. quant="amax": returns (out, (fp32 [B, heads],)),
    each head's max |out|: the row's absmax in parts, for gemv_fp8_quantizing (batch 1).
    pdl: as splitk.use_pdl."""
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
    interp = interpreted()
    pdl = use_pdl(dev, pdl)
    _attn_chunk_kernel[(bsz, kvh, nsplit)](
        q, k_cache, v_cache, slots, lengths, po, pm, pl, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), scale, nsplit, G=g, GP=max(16, triton.next_power_of_2(g)), HD=hd,
        BT=32 if interp else KEY_TILE, CHUNK_=chunk, INTERPRET=interp, num_warps=CHUNK_WARPS, PDL=pdl, launch_pdl=pdl,
        PREFETCH=bool(CHUNK_PREFETCH) and bsz == 1 and not interp, LINE=128 // k_cache.element_size())
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

