"""The end of a greedy decode step in one launch: each row's argmax over the vocabulary, written
as the step's tokens and as the next step's input (the token into the meta's first row, the
length one more unless the row sits on the sentinel slot).

In torch this is torch.argmax's reduction (one program per row over Qwen3.5's 248,320 logits)
and three small kernels after it, none PDL-launched. Here the vocabulary is split over many
programs; each writes its chunk's best, and the row's last program to finish (a ticket, as the
split-K GEMVs reduce, splitk.py) picks the row's best.

Ties and NaN as torch.argmax: the first index of the maximum; a NaN counts as larger than
everything, so the first NaN wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .splitk import start_after_producer, use_pdl, workspace

CHUNK = 4096  # logits per program


@triton.jit
def _best(v, idx, BIG: tl.constexpr):
    """(value, index) of the best of v (fp32) by torch.argmax's order: NaN first, then the
    largest, ties to the smallest index. Lanes to ignore carry v = -inf and idx = BIG."""
    nan = v != v
    any_nan = tl.max(nan.to(tl.int32), 0) > 0
    m = tl.max(tl.where(nan, float("-inf"), v), 0)
    cand = tl.where(any_nan, nan, v == m)
    bi = tl.min(tl.where(cand, idx, BIG), 0)
    bv = tl.where(any_nan, float("nan"), m)
    return bv, bi


@triton.jit
def _greedy_advance_kernel(logit_ptr, ws_ptr, tick_ptr, nxt_ptr, tok_ptr, slot_ptr, len_ptr, V, stride_l, SENTINEL,
                           CHUNKS: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr, PDL: tl.constexpr):
    start_after_producer(PDL)  # the logits come from the lm_head GEMV before this kernel
    b = tl.program_id(0)
    c = tl.program_id(1)
    BIG: tl.constexpr = 2**31 - 1
    rc = c * BC + tl.arange(0, BC)
    m = rc < V
    v = tl.load(logit_ptr + b * stride_l + rc, mask=m, other=float("-inf")).to(tl.float32)
    bv, bi = _best(v, tl.where(m, rc, BIG), BIG)
    # the chunk's best: value, then index as fp32 (exact below 2^24, checked at launch)
    tl.store(ws_ptr + (b * CHUNKS + c) * 2, bv)
    tl.store(ws_ptr + (b * CHUNKS + c) * 2 + 1, bi.to(tl.float32))
    # every store is made before the ticket releases it; the last program acquires the others'
    tl.debug_barrier()
    ticket = tl.atomic_add(tick_ptr + b, 1, sem="acq_rel")
    tl.debug_barrier()
    if ticket == CHUNKS - 1:
        rp = tl.arange(0, BP)
        pm = rp < CHUNKS
        cv = tl.load(ws_ptr + (b * CHUNKS + rp) * 2, mask=pm, other=float("-inf"), cache_modifier=".cg")
        ci = tl.load(ws_ptr + (b * CHUNKS + rp) * 2 + 1, mask=pm, other=0.0, cache_modifier=".cg")
        _, tok = _best(cv, tl.where(pm, ci.to(tl.int32), BIG), BIG)
        tl.store(nxt_ptr + b, tok.to(tl.int64))
        tl.store(tok_ptr + b, tok.to(tl.int64))
        length = tl.load(len_ptr + b)
        tl.store(len_ptr + b, tl.where(tl.load(slot_ptr + b) != SENTINEL, length + 1, length))
        tl.atomic_xchg(tick_ptr + b, 0)


def greedy_advance(logits: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                   sentinel: int, pdl: bool | None = None) -> torch.Tensor:
    """logits [B, V] (row stride free); tokens, slots, lengths int64 [B], rows of the step's meta,
    updated in place: tokens = each row's argmax, lengths + 1 where slots != sentinel. Returns
    the argmax, int64 [B]. pdl: as splitk.use_pdl."""
    bsz, vocab = logits.shape
    if logits.stride(1) != 1 or vocab >= 2**24 or any(t.shape != (bsz,) or t.dtype != torch.int64
                                                       for t in (tokens, slots, lengths)):
        raise ValueError(f"greedy_advance: logits {tuple(logits.shape)}, meta rows "
                         f"{[tuple(t.shape) for t in (tokens, slots, lengths)]} do not fit")
    chunks = triton.cdiv(vocab, CHUNK)
    ws, tick = workspace(logits.device, (bsz, chunks, 2), bsz, owner="greedy_advance")
    nxt = torch.empty(bsz, dtype=torch.int64, device=logits.device)
    pdl = use_pdl(logits.device, pdl)
    _greedy_advance_kernel[(bsz, chunks)](logits, ws, tick, nxt, tokens, slots, lengths, vocab, logits.stride(0),
                                          sentinel, CHUNKS=chunks, BC=CHUNK, BP=triton.next_power_of_2(chunks),
                                          num_warps=8, PDL=pdl, launch_pdl=pdl)
    return nxt

