"""Speculative-decoding verify and commit for a Gated DeltaNet layer: T = k + 1 tokens per slot in
one pass, then a rollback to each row's accepted length that costs an index, never a recompute of
the prefix.

What it computes. `gdn_verify` scores T tokens per row: for each row b and position t = 0 … T-1
exactly what gdn_decode computes for one token — the causal conv1d with SiLU over the conv state and
the new columns, q / k L2-normalized (q also scaled by K^-1/2), g = -exp(A_log)·softplus(a + dt_bias),
β = sigmoid(b), the delta rule on the fp32 state S [V, K] of each value head

    S ← S·exp(g);  δ = β·(v − S k);  S ← S + δ kᵀ;  o = S q

and the gated RMSNorm o/rms(o)·w·silu(z) — so its outputs [B, T, HV·V] equal T sequential gdn_decode
calls. It keeps what rollback needs in a `SpecScratch`. `gdn_commit`, given accepted lengths
n_b ∈ [1, T] per row (on the device), leaves the slot's recurrent state and conv state as if exactly
n_b tokens had been decoded. n_b ≥ 1 always (position 0 is the target's own token), so the state
before the verify is never needed again.

Designs (the scratch's `design`):
- "states" (A): verify writes the state after tokens 1 … T-1 into the scratch ([rows, T-1, HV, V, K]
  fp32: 2 MiB a token and row at the 4B) and the state after token T into the slot; commit copies
  state n_b over the slot where n_b < T.
- "replay" (B, ReplaySSM): verify writes no state (the slot keeps its checkpoint); commit reads the
  checkpoint, replays the first n_b updates from the kept step inputs (k, v, g, β after the conv:
  small) and writes the state. A verify may also be given the previous step's scratch as `pending`:
  it then commits that step first, in the same pass over the state (read once, written once a step),
  and the standalone commit is needed only where a slot must be committed without a next verify
  (its sequence ends, a plain decode step follows).
Both keep the conv window: the last (kernel-1) + T input columns of every channel (the slot's conv
state, then the T new columns), [rows, kernel-1+T, C] in the conv state's dtype; commit writes
positions n_b … n_b+kernel-2 of it as the slot's conv state. The verify writes the conv state only
when it commits a pending step.

State layout contract (as gdn_decode): recurrent state fp32 [slots, HV, V, K] contiguous, conv state
[slots, C, kernel-1] (last dim contiguous, kernel ≤ 4), C = 2·H·K + HV·V channels in in_proj_qkv's order
(q, k, v). Inputs per row and position: qkv [B, T, C], z [B, T, HV·V], a and b [B, T, HV] (last dims
contiguous, any row and position strides, e.g. views of a [B·T, N] GEMV output). slots int32 [B]; a
negative slot is a padding row: verify writes zeros there, commit skips it. A scratch holds at least B
rows and is indexed by row, not slot: what one verify wrote is what the next commit (or pending verify)
reads for the same rows; every GDN layer needs its own (the commits follow the whole forward). Between
a verify and its commit nothing else may write the rows' slots.

How. Two launches per verify. `_inputs_kernel`, one program per (row, head of q, k or v): the conv
over the window for all T tokens, SiLU, the L2 norm of a q / k head, the gates of a v head, into the
scratch (what replay needs anyway, and q), once per head rather than once per state tile. Then
`_verify_kernel`, one program per (row, value head, block of V rows): the state tile in registers,
each token's q, k, v, g, β loaded (the next token's while this one computes), S·k and S·q reduced
together before the update (o = e^g·(S q) + δ (k·q)), o rows unnormalized to an fp32 workspace; a
ticket per (row, value head), and the last of the head's V-blocks applies the gated RMSNorm to the T
whole rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .splitk import sm_count, use_pdl, wait_for_inputs, workspace

DESIGNS = ("states", "replay")
MIN_V_ROWS = 8  # the smallest V-block _v_blocks makes
# The largest: an 8 x 128 fp32 tile a warp took 80 registers (verify), 64 (commit); 16 rows 168 (Triton 3.9, sm_90,
# compiled without a GPU; not yet timed: bench_kernels.py --only gdn_verify sweeps V-blocks x warps).
MAX_V_ROWS = 8
WARPS = 1  # a state tile per warp: its K-reductions stay inside the warp (shuffles, no barrier)


@dataclass(frozen=True)
class SpecScratch:
    """What gdn_verify keeps for gdn_commit, for up to `rows` rows of `tokens` positions (fp32 unless said):
    window [rows, kernel-1+tokens, C] (conv-state dtype), queries / keys [rows, tokens, H, K] (after conv,
    SiLU, L2 norm; q scaled), values [rows, tokens, HV, V], gates [rows, tokens, HV, 2] (g, β); design
    "states" also states [rows, tokens-1, HV, V, K], the state after tokens 1 … T-1."""

    design: str
    tokens: int
    window: torch.Tensor
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    gates: torch.Tensor
    states: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.window.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        all_ = (self.window, self.queries, self.keys, self.values, self.gates, self.states)
        return [t for t in all_ if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass(frozen=True)
class Pending:
    """A speculative step not yet committed, for gdn_verify to commit first (design "replay"): the scratch its
    verify filled (not the one the new verify fills), for each new row the row its slot had in that step
    (int32 [B], negative: nothing pending, the slot is committed), and that step's accepted lengths (int32,
    one per row of that step)."""

    scratch: SpecScratch
    rows: torch.Tensor
    accepted: torch.Tensor


def spec_scratch(design: str, rows: int, tokens: int, num_k_heads: int, head_k_dim: int, num_v_heads: int,
                 head_v_dim: int, kernel: int = 4, device="cuda", conv_dtype=torch.bfloat16) -> SpecScratch:
    """A scratch for `rows` rows of `tokens` (= k + 1) positions of one GDN layer. A CUDA-graph bucket of fewer
    rows can use a scratch made for more (it is indexed by row)."""
    if design not in DESIGNS:
        raise ValueError(f"spec_scratch: design must be one of {DESIGNS}, got {design!r}")
    if tokens < 1:
        raise ValueError(f"spec_scratch: tokens must be >= 1, got {tokens}")
    H, K, HV, V = num_k_heads, head_k_dim, num_v_heads, head_v_dim
    C = 2 * H * K + HV * V
    f32 = dict(dtype=torch.float32, device=device)
    return SpecScratch(design, tokens, torch.zeros(rows, kernel - 1 + tokens, C, dtype=conv_dtype, device=device),
                       torch.zeros(rows, tokens, H, K, **f32), torch.zeros(rows, tokens, H, K, **f32),
                       torch.zeros(rows, tokens, HV, V, **f32), torch.zeros(rows, tokens, HV, 2, **f32),
                       torch.zeros(rows, tokens - 1, HV, V, K, **f32) if design == "states" else None)


@triton.jit
def _inputs_kernel(qkv_ptr, a_ptr, b_ptr, cs_ptr, cw_ptr, alog_ptr, dtb_ptr, slot_ptr,
                   win_ptr, q_ptr, k_ptr, v_ptr, gb_ptr, pwin_ptr, prow_ptr, pacc_ptr,
                   sq_b, sq_t, sa_b, sa_t, sb_b, sb_t, cs_stride_slot, cs_stride_c, win_b, q_b, k_b, v_b, gb_b,
                   pwin_b,
                   T: tl.constexpr, TP: tl.constexpr, WP: tl.constexpr, PT: tl.constexpr, H: tl.constexpr,
                   HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KW: tl.constexpr, BC: tl.constexpr,
                   PENDING: tl.constexpr, PDL: tl.constexpr):
    """Program (row, j): head j of q (j < H), k (j < 2H) or v. The window [KW-1 + T, head's channels] into the
    scratch; the conv of every token, SiLU, then the L2 norm (q, k) or the gates (v). PENDING: the history
    comes from the pending step's window at its accepted length, and is the slot's committed conv state."""
    C: tl.constexpr = 2 * H * K + HV * V
    WL: tl.constexpr = KW - 1 + T
    bi = tl.program_id(0)
    j = tl.program_id(1)
    bi64 = bi.to(tl.int64)
    slot_raw = tl.load(slot_ptr + bi)
    if slot_raw < 0:
        return
    slot = slot_raw.to(tl.int64)
    is_v = j >= 2 * H
    base = tl.where(is_v, 2 * H * K + (j - 2 * H) * V, j * K)
    hd = tl.where(is_v, V, K)
    rc = tl.arange(0, BC)
    chan = base + rc
    c_ok = rc < hd
    pp = tl.arange(0, WP)
    hist = (pp < KW - 1)[:, None] & c_ok[None, :]
    cs = cs_ptr + slot * cs_stride_slot
    wait_for_inputs(PDL)
    if PENDING:
        pr = tl.load(prow_ptr + bi)
        prs = tl.maximum(pr, 0).to(tl.int64)
        n_prev = tl.minimum(tl.maximum(tl.load(pacc_ptr + prs), 1), PT)
        pend = (pp * 0 + pr)[:, None] >= 0  # a block, not a scalar: the interpreter rejects scalar masks
        from_pw = hist & pend
        hp = tl.load(pwin_ptr + prs * pwin_b + (n_prev + pp[:, None]) * C + chan[None, :], mask=from_pw, other=0.0)
        hc = tl.load(cs + chan[None, :] * cs_stride_c + pp[:, None], mask=hist & (pend == 0), other=0.0)
        hw = hc + hp
        # The pending step's commit of the conv state: only this program reads these channels' history.
        tl.store(cs + chan[None, :] * cs_stride_c + pp[:, None], hp, mask=from_pw)
    else:
        hw = tl.load(cs + chan[None, :] * cs_stride_c + pp[:, None], mask=hist, other=0.0)
    xs = tl.load(qkv_ptr + bi64 * sq_b + (pp - (KW - 1))[:, None] * sq_t + chan[None, :],
                 mask=((pp >= KW - 1) & (pp < WL))[:, None] & c_ok[None, :], other=0.0)
    win_row = win_ptr + bi64 * win_b
    tl.store(win_row + pp[:, None] * C + chan[None, :], (hw.to(tl.float32) + xs.to(tl.float32)).to(
        win_ptr.dtype.element_ty), mask=(pp < WL)[:, None] & c_ok[None, :])
    tl.debug_barrier()  # the window is read back below, by other threads of this program
    tt = tl.arange(0, TP)
    ok = (tt < T)[:, None] & c_ok[None, :]
    y = tl.zeros([TP, BC], dtype=tl.float32)
    for d in tl.static_range(KW):
        w = tl.load(cw_ptr + chan * KW + d, mask=c_ok, other=0.0).to(tl.float32)
        x = tl.load(win_row + (tt + d)[:, None] * C + chan[None, :], mask=ok, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        y += x * w[None, :]
    y = y / (1.0 + tl.exp(-y))
    if is_v:
        hv = j - 2 * H
        tl.store(v_ptr + bi64 * v_b + tt[:, None] * HV * V + hv * V + rc[None, :], y, mask=ok)
        t_ok = tt < T
        a = tl.load(a_ptr + bi64 * sa_b + tt * sa_t + hv, mask=t_ok, other=0.0).to(tl.float32)
        a = a + tl.load(dtb_ptr + hv).to(tl.float32)
        g = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32)) * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + bi64 * sb_b + tt * sb_t + hv, mask=t_ok, other=0.0).to(
            tl.float32)))
        tl.store(gb_ptr + bi64 * gb_b + (tt * HV + hv) * 2, g, mask=t_ok)
        tl.store(gb_ptr + bi64 * gb_b + (tt * HV + hv) * 2 + 1, beta, mask=t_ok)
    else:
        y = y * tl.rsqrt(tl.sum(y * y, 1) + 1e-6)[:, None]
        if j < H:
            tl.store(q_ptr + bi64 * q_b + tt[:, None] * H * K + j * K + rc[None, :], y * (1.0 / tl.sqrt(K * 1.0)),
                     mask=ok)
        else:
            tl.store(k_ptr + bi64 * k_b + tt[:, None] * H * K + (j - H) * K + rc[None, :], y, mask=ok)


@triton.jit
def _replay(S, pk, pv, pg, n, k_ok, v_ok, H: tl.constexpr, K: tl.constexpr, HV: tl.constexpr, V: tl.constexpr):
    """A state tile [BV, BK] after the first n delta-rule updates kept in a scratch (pk, pv, pg: this row's
    and head's keys, values and (g, beta) at token 0): the one replay of commit and of a pending commit."""
    for t in range(n):
        k = tl.load(pk + t * H * K, mask=k_ok, other=0.0)
        v = tl.load(pv + t * HV * V, mask=v_ok, other=0.0)
        decay = tl.exp(tl.load(pg + t * HV * 2))
        u = tl.load(pg + t * HV * 2 + 1) * (v - decay * tl.sum(S * k[None, :], 1))
        S = S * decay + u[:, None] * k[None, :]
    return S


@triton.jit
def _verify_kernel(z_ptr, nw_ptr, s_ptr, slot_ptr, out_ptr, ws_ptr, tick_ptr, q_ptr, k_ptr, v_ptr, gb_ptr, hs_ptr,
                   pk_ptr, pv_ptr, pgb_ptr, prow_ptr, pacc_ptr,
                   sz_b, sz_t, s_stride_slot, so_b, so_t, q_b, k_b, v_b, gb_b, hs_b, pk_b, pv_b, pgb_b, eps,
                   T: tl.constexpr, TP: tl.constexpr, PT: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NVB: tl.constexpr,
                   BVF: tl.constexpr, REPLAY: tl.constexpr, PENDING: tl.constexpr, EARLY_S: tl.constexpr,
                   PDL: tl.constexpr):
    """REPLAY: 0 design "states" (intermediate states to hs, the last into the slot), 1 "replay" (the slot's
    state untouched, unless PENDING: the pending step's accepted prefix replayed first, written as the slot's
    committed state). Tickets: [B·HV] per (row, value head)."""
    G: tl.constexpr = HV // H
    pid = tl.program_id(0)
    vb = pid % NVB
    hv = (pid // NVB) % HV
    bi = pid // (NVB * HV)
    h = hv // G
    bi64 = bi.to(tl.int64)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    k_ok = rk < K
    v_ok = rv < V
    slot_raw = tl.load(slot_ptr + bi)
    if slot_raw < 0:  # a padding row (CUDA-graph buckets): zeros out, no state touched, no ticket
        tt = tl.arange(0, TP)
        zero = tl.zeros([TP, BV], dtype=tl.float32).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + bi64 * so_b + tt[:, None] * so_t + hv * V + rv[None, :], zero,
                 mask=(tt < T)[:, None] & v_ok[None, :])
        return
    slot = slot_raw.to(tl.int64)
    sp = s_ptr + slot * s_stride_slot + hv * V * K + rv[:, None] * K + rk[None, :]
    smask = v_ok[:, None] & k_ok[None, :]
    # The state is this layer's own: under PDL (small tiles) it loads while the inputs kernel finishes.
    if EARLY_S:
        S = tl.load(sp, mask=smask, other=0.0)
    wait_for_inputs(PDL)
    if not EARLY_S:  # far larger than L2 above batch 1: read once, evict first
        S = tl.load(sp, mask=smask, other=0.0, eviction_policy="evict_first")
    if PENDING:
        pr = tl.load(prow_ptr + bi)
        if pr >= 0:  # commit the pending step: replay its accepted prefix, write the slot's state
            prs = pr.to(tl.int64)
            n_prev = tl.minimum(tl.maximum(tl.load(pacc_ptr + prs), 1), PT)
            S = _replay(S, pk_ptr + prs * pk_b + h * K + rk, pv_ptr + prs * pv_b + hv * V + rv,
                        pgb_ptr + prs * pgb_b + hv * 2, n_prev, k_ok, v_ok, H, K, HV, V)
            tl.store(sp, S, mask=smask)
    qp = q_ptr + bi64 * q_b + h * K + rk
    kp = k_ptr + bi64 * k_b + h * K + rk
    vp = v_ptr + bi64 * v_b + hv * V + rv
    gp = gb_ptr + bi64 * gb_b + hv * 2
    q = tl.load(qp, mask=k_ok, other=0.0)
    k = tl.load(kp, mask=k_ok, other=0.0)
    v = tl.load(vp, mask=v_ok, other=0.0)
    g = tl.load(gp)
    beta = tl.load(gp + 1)
    ws = ws_ptr + bi64 * T * HV * V + hv * V + rv
    for t in range(T):
        # token t+1's inputs first (the last token's again past the end): they load while this one computes
        tn = tl.minimum(t + 1, T - 1)
        nq = tl.load(qp + tn * H * K, mask=k_ok, other=0.0)
        nk = tl.load(kp + tn * H * K, mask=k_ok, other=0.0)
        nv = tl.load(vp + tn * HV * V, mask=v_ok, other=0.0)
        ng = tl.load(gp + tn * HV * 2)
        nbeta = tl.load(gp + tn * HV * 2 + 1)
        # S·k and S·q of the state before the update, reduced together: o = e^g·(S q) + δ·(k·q)
        sk = tl.sum(S * k[None, :], 1)
        sq = tl.sum(S * q[None, :], 1)
        kq = tl.sum(k * q, 0)
        decay = tl.exp(g)
        u = beta * (v - decay * sk)
        S = S * decay + u[:, None] * k[None, :]
        tl.store(ws + t * HV * V, decay * sq + u * kq, mask=v_ok)
        if not REPLAY:
            if t < T - 1:
                tl.store(hs_ptr + bi64 * hs_b + t * HV * V * K + hv * V * K + rv[:, None] * K + rk[None, :], S,
                         mask=smask, cache_modifier=".cs")
        q, k, v, g, beta = nq, nk, nv, ng, nbeta
    if not REPLAY:
        tl.store(sp, S, mask=smask, cache_modifier=".cs")
    # Every thread's o rows are stored (barrier) before the ticket releases them; the last ticket acquires the
    # others', and the barrier after it keeps its reads behind it.
    tl.debug_barrier()
    ticket = tl.atomic_add(tick_ptr + bi * HV + hv, 1, sem="acq_rel")
    tl.debug_barrier()
    if ticket == NVB - 1:
        tt = tl.arange(0, TP)
        rf = tl.arange(0, BVF)
        ok = (tt < T)[:, None] & (rf < V)[None, :]
        of = tl.load(ws_ptr + bi64 * T * HV * V + tt[:, None] * HV * V + hv * V + rf[None, :], mask=ok, other=0.0,
                     cache_modifier=".cg")
        of = of * tl.rsqrt(tl.sum(of * of, 1) / V + eps)[:, None]
        nw = tl.load(nw_ptr + rf, mask=rf < V, other=0.0).to(tl.float32)
        zf = tl.load(z_ptr + bi64 * sz_b + tt[:, None] * sz_t + hv * V + rf[None, :], mask=ok, other=0.0)
        zf = zf.to(tl.float32)
        of = of * nw[None, :] * (zf / (1.0 + tl.exp(-zf)))
        tl.store(out_ptr + bi64 * so_b + tt[:, None] * so_t + hv * V + rf[None, :], of.to(out_ptr.dtype.element_ty),
                 mask=ok)
        tl.atomic_xchg(tick_ptr + bi * HV + hv, 0)


@triton.jit
def _commit_kernel(s_ptr, cs_ptr, slot_ptr, acc_ptr, win_ptr, hs_ptr, kk_ptr, vv_ptr, gb_ptr,
                   cs_stride_slot, cs_stride_c, s_stride_slot, win_b, hs_b, kk_b, vv_b, gb_b,
                   T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   KW: tl.constexpr, KWP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NVB: tl.constexpr,
                   CB: tl.constexpr, REPLAY: tl.constexpr):
    G: tl.constexpr = HV // H
    C: tl.constexpr = 2 * H * K + HV * V
    pid = tl.program_id(0)
    vb = pid % NVB
    hv = (pid // NVB) % HV
    bi = pid // (NVB * HV)
    h = hv // G
    bi64 = bi.to(tl.int64)
    slot_raw = tl.load(slot_ptr + bi)
    if slot_raw < 0:
        return
    slot = slot_raw.to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(acc_ptr + bi), 1), T)
    # Conv state: window positions n … n+KW-2, this program's share of the channels.
    chan = (hv * NVB + vb) * CB + tl.arange(0, CB)
    j = tl.arange(0, KWP)
    cm = (chan < C)[:, None] & (j < KW - 1)[None, :]
    cols = tl.load(win_ptr + bi64 * win_b + (n + j[None, :]) * C + chan[:, None], mask=cm)
    tl.store(cs_ptr + slot * cs_stride_slot + chan[:, None] * cs_stride_c + j[None, :], cols, mask=cm)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    k_ok = rk < K
    v_ok = rv < V
    smask = v_ok[:, None] & k_ok[None, :]
    tile = hv * V * K + rv[:, None] * K + rk[None, :]
    sp = s_ptr + slot * s_stride_slot + tile
    if REPLAY:  # _replay, as a pending commit inside the verify does: the same state
        S = tl.load(sp, mask=smask, other=0.0, eviction_policy="evict_first")
        S = _replay(S, kk_ptr + bi64 * kk_b + h * K + rk, vv_ptr + bi64 * vv_b + hv * V + rv,
                    gb_ptr + bi64 * gb_b + hv * 2, n, k_ok, v_ok, H, K, HV, V)
        tl.store(sp, S, mask=smask, cache_modifier=".cs")
    else:
        if n < T:  # n == T: verify left the state after token T in the slot already
            S = tl.load(hs_ptr + bi64 * hs_b + (n - 1) * HV * V * K + tile, mask=smask, other=0.0,
                        eviction_policy="evict_first")
            tl.store(sp, S, mask=smask, cache_modifier=".cs")


def _v_blocks(bsz: int, hv: int, v: int, device) -> int:
    """V-blocks per value head: blocks of at most MAX_V_ROWS rows, more until ~16 programs (one warp each) per SM,
    blocks of at least MIN_V_ROWS rows."""
    nvb = max(1, triton.cdiv(v, MAX_V_ROWS))
    while bsz * hv * nvb < 16 * sm_count(device) and v // (2 * nvb) >= MIN_V_ROWS:
        nvb *= 2
    return nvb


def _check(where, state, conv_state, scratch, hv, V, K, C, kw, bsz):
    if state.dtype != torch.float32 or tuple(state.shape[1:]) != (hv, V, K) or not state.is_contiguous():
        raise ValueError(f"{where}: state must be contiguous fp32 [slots, {hv}, {V}, {K}], got "
                         f"{state.dtype} {tuple(state.shape)}")
    if tuple(conv_state.shape[1:]) != (C, kw - 1) or conv_state.stride(2) != 1:
        raise ValueError(f"{where}: conv_state must be [slots, {C}, {kw - 1}] with a contiguous last dim, got "
                         f"{tuple(conv_state.shape)}")
    if not 2 <= kw <= 4:
        raise ValueError(f"{where}: conv kernels of 2 to 4 taps only, got {kw}")
    T = scratch.tokens
    if scratch.rows < bsz or tuple(scratch.window.shape[1:]) != (kw - 1 + T, C) or \
            scratch.window.dtype != conv_state.dtype or scratch.values.shape[2:] != (hv, V) or \
            scratch.keys.shape[3] != K:
        raise ValueError(f"{where}: scratch window {tuple(scratch.window.shape)} {scratch.window.dtype}, values "
                         f"{tuple(scratch.values.shape)} do not fit {bsz} rows, {C} channels, kernel {kw}, {T} "
                         f"tokens, HV={hv}, V={V}, K={K}, conv state {conv_state.dtype}")
    if not all(t.is_contiguous() for t in scratch.tensors()):
        raise ValueError(f"{where}: scratch tensors must be contiguous")


def gdn_verify(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, norm_weight, state, slots,
               scratch: SpecScratch, num_k_heads: int, head_k_dim: int, head_v_dim: int, eps: float = 1e-6, out=None,
               pending: Pending | None = None, v_blocks: int | None = None, num_warps: int | None = None,
               pdl: bool | None = None):
    """qkv [B, T, C] (in_proj_qkv output), z [B, T, HV·V], a, b [B, T, HV]; conv_state [slots, C, KW-1],
    conv_weight [C, KW]; A_log, dt_bias [HV]; norm_weight [V]; state fp32 [slots, HV, V, K]; slots int32 [B]
    (negative: padding row); scratch from spec_scratch(…, tokens=T) with at least B rows. Returns the gated-
    normed outputs [B, T, HV·V] (qkv's dtype unless `out` says otherwise) of T sequential decode steps, and
    fills the scratch for gdn_commit. Design "states" also leaves the state after all T tokens in the slots;
    "replay" leaves the slots as they were, except that with `pending` (design "replay" only) the pending
    step is committed first (conv state and state). v_blocks, num_warps: the state kernel's V-blocks per value
    head and warps (defaults from the batch and the SM count); pdl: as splitk.use_pdl."""
    bsz, T, C = qkv.shape
    hv = A_log.shape[0]
    H, K, V = num_k_heads, head_k_dim, head_v_dim
    kw = conv_weight.shape[-1]
    conv_weight = conv_weight.reshape(conv_weight.shape[0], kw)
    if C != 2 * H * K + hv * V or T != scratch.tokens:
        raise ValueError(f"gdn_verify: qkv {tuple(qkv.shape)} does not match H={H}, K={K}, HV={hv}, V={V}, "
                         f"scratch tokens {scratch.tokens}")
    if z.shape != (bsz, T, hv * V) or a.shape != (bsz, T, hv) or b.shape != (bsz, T, hv):
        raise ValueError(f"gdn_verify: z {tuple(z.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)} do not match "
                         f"[{bsz}, {T}, ...]")
    if qkv.stride(2) != 1 or z.stride(2) != 1 or a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError("gdn_verify: the last dims of qkv, z, a and b must be contiguous")
    _check("gdn_verify", state, conv_state, scratch, hv, V, K, C, kw, bsz)
    if pending is not None:
        p = pending.scratch
        if scratch.design != "replay" or p.design != "replay" or p.window.data_ptr() == scratch.window.data_ptr():
            raise ValueError("gdn_verify: a pending step needs design 'replay' and its own scratch (not this one)")
        _check("gdn_verify (pending)", state, conv_state, p, hv, V, K, C, kw, 0)
        if pending.rows.shape != (bsz,) or pending.accepted.shape[0] > p.rows:
            raise ValueError(f"gdn_verify: pending rows {tuple(pending.rows.shape)} / accepted "
                             f"{tuple(pending.accepted.shape)} do not match {bsz} rows, a scratch of {p.rows}")
    out = torch.empty(bsz, T, hv * V, dtype=qkv.dtype, device=qkv.device) if out is None else out
    if out.shape != (bsz, T, hv * V) or out.stride(2) != 1:
        raise ValueError(f"gdn_verify: out must be [{bsz}, {T}, {hv * V}] with a contiguous last dim")
    pdl = use_pdl(qkv.device, pdl)
    pw, prow, pacc = (pending.scratch, pending.rows, pending.accepted) if pending else (scratch, slots, slots)
    _inputs_kernel[(bsz, 2 * H + hv)](
        qkv, a, b, conv_state, conv_weight, A_log, dt_bias, slots, scratch.window, scratch.queries, scratch.keys,
        scratch.values, scratch.gates, pw.window, prow, pacc,
        qkv.stride(0), qkv.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1), conv_state.stride(0),
        conv_state.stride(1), scratch.window.stride(0), scratch.queries.stride(0), scratch.keys.stride(0),
        scratch.values.stride(0), scratch.gates.stride(0), pw.window.stride(0),
        T=T, TP=triton.next_power_of_2(T), WP=triton.next_power_of_2(kw - 1 + T), PT=pw.tokens, H=H, HV=hv, K=K,
        V=V, KW=kw, BC=triton.next_power_of_2(max(K, V)), PENDING=pending is not None, PDL=pdl,
        num_warps=4, launch_pdl=pdl)
    nvb = v_blocks or _v_blocks(bsz, hv, V, qkv.device)
    bv = triton.next_power_of_2(triton.cdiv(V, nvb))
    bk = triton.next_power_of_2(K)
    ws, tick = workspace(qkv.device, (bsz, T, hv, V), bsz * hv, owner="gdn_verify")
    early = pdl and bv * bk <= 16 * 128  # as gdn_decode: only small state tiles load before the wait
    hs = scratch.states if scratch.states is not None and scratch.states.numel() else scratch.values
    _verify_kernel[(bsz * hv * triton.cdiv(V, bv),)](
        z, norm_weight, state, slots, out, ws, tick, scratch.queries, scratch.keys, scratch.values, scratch.gates,
        hs, pw.keys, pw.values, pw.gates, prow, pacc,
        z.stride(0), z.stride(1), state.stride(0), out.stride(0), out.stride(1), scratch.queries.stride(0),
        scratch.keys.stride(0), scratch.values.stride(0), scratch.gates.stride(0), hs.stride(0), pw.keys.stride(0),
        pw.values.stride(0), pw.gates.stride(0), eps,
        T=T, TP=triton.next_power_of_2(T), PT=pw.tokens, H=H, HV=hv, K=K, V=V, BK=bk, BV=bv,
        NVB=triton.cdiv(V, bv), BVF=triton.next_power_of_2(V), REPLAY=scratch.design == "replay",
        PENDING=pending is not None, EARLY_S=early, PDL=pdl, num_warps=num_warps or WARPS, launch_pdl=pdl)
    return out


def gdn_commit(scratch: SpecScratch, conv_state, state, slots, accepted, num_k_heads: int, head_k_dim: int,
               head_v_dim: int, v_blocks: int | None = None, num_warps: int | None = None):
    """After gdn_verify with the same scratch, rows and slots: leave each row's slot state and conv state as if
    exactly accepted[b] ∈ [1, T] tokens had been decoded (int32 [B] on the device; clamped into [1, T]).
    Padding rows (negative slots) are skipped. In place; returns nothing."""
    bsz = slots.shape[0]
    hv, V, K = state.shape[1], head_v_dim, head_k_dim
    H = num_k_heads
    C = conv_state.shape[1]
    kw = conv_state.shape[2] + 1
    if C != 2 * H * K + hv * V or accepted.shape != (bsz,):
        raise ValueError(f"gdn_commit: conv_state {tuple(conv_state.shape)} / accepted {tuple(accepted.shape)} do "
                         f"not match H={H}, K={K}, HV={hv}, V={V}, {bsz} rows")
    _check("gdn_commit", state, conv_state, scratch, hv, V, K, C, kw, bsz)
    nvb = v_blocks or _v_blocks(bsz, hv, V, state.device)
    bv = triton.next_power_of_2(triton.cdiv(V, nvb))
    nvb = triton.cdiv(V, bv)
    hs = scratch.states if scratch.states is not None and scratch.states.numel() else scratch.values
    _commit_kernel[(bsz * hv * nvb,)](
        state, conv_state, slots, accepted, scratch.window, hs, scratch.keys, scratch.values, scratch.gates,
        conv_state.stride(0), conv_state.stride(1), state.stride(0), scratch.window.stride(0), hs.stride(0),
        scratch.keys.stride(0), scratch.values.stride(0), scratch.gates.stride(0),
        T=scratch.tokens, H=H, HV=hv, K=K, V=V, KW=kw, KWP=triton.next_power_of_2(kw), BK=triton.next_power_of_2(K),
        BV=bv, NVB=nvb, CB=triton.next_power_of_2(triton.cdiv(C, hv * nvb)), REPLAY=scratch.design == "replay",
        num_warps=num_warps or WARPS)
