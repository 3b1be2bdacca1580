"""One decode step of a Gated DeltaNet layer for a batch of slots, in one launch.

Between in_proj_* and out_proj, everything Qwen3.5's GDN does for one token: the causal
conv1d (kernel 4) state update and SiLU, the split into q / k / v, q and k L2-normalized (q
also scaled by K^-1/2), the gates g = -exp(A_log)·softplus(a + dt_bias) and β = sigmoid(b),
the delta-rule update of the fp32 recurrent state S [slots, HV, V, K] in place

    S ← S·exp(g);  δ = β·(v − S k);  S ← S + δ kᵀ;  o = S q

and the gated RMSNorm  o/rms(o) · w · silu(z). transformers does this in ~10 launches of glue
around fla-core's recurrent kernel; here the state is read and written once and nothing else
goes to memory.

One program per (batch row, value head, block of V rows). S's V rows are independent in the
delta rule (each row needs q and k whole, v and its own row of S), so at batch 1 the 32 value
heads of the 4B split into V-blocks until ~4 programs per SM stream the state; with one program
per key head, 16 SMs did all the work. What crosses the blocks goes through a ticket per
(row, key head), as in splitk.py: each program writes its o rows unnormalized to an fp32
workspace and takes a ticket; the last of the key head's programs (its HV/H value heads ×
V-blocks)
- applies the gated RMSNorm, which needs the whole V row of o, to each of those value heads;
- shifts the conv state of the key head's q and k channels. Every program has read them by
  then; the v channels of a block belong to that program alone and shift at once.
A row whose slot index is negative is a padding row (CUDA-graph buckets): it touches no state
and writes zeros.

With `quant="fp8"` (an FP8 out_proj) the row's output is also quantized per token, as
quant_fp8_per_token does, which needs the whole row: the key heads' last programs take a second
ticket per row, and the last of those quantizes the row — one launch a GDN layer fewer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv_fp8 import quant_fp8_row_when_last
from .splitk import sm_count, use_pdl, wait_for_inputs, workspace


MIN_V_ROWS = 16  # the smallest V-block _v_blocks makes (batch 1 at the 4B: 8 blocks of 16 rows, 256 programs)
WARPS = 4  # warps per program, at every batch (see the launch)


@triton.jit
def _conv_taps(cs_ptr, cw_ptr, chan, n_ok, cs_stride_c, slot_raw, KW: tl.constexpr, KWP: tl.constexpr):
    """The conv state (KW-1 taps) and weights of channels `chan`: [chan, KWP] each, fp32. Neither
    is written by the kernels before this one, so they load before waiting on them (PDL)."""
    j = tl.arange(0, KWP)
    valid = (j[None, :] * 0 + slot_raw) >= 0  # a block, not a scalar: the interpreter rejects scalar masks
    st_mask = n_ok[:, None] & (j[None, :] < KW - 1) & valid
    st = tl.load(cs_ptr + chan[:, None] * cs_stride_c + j[None, :], mask=st_mask, other=0.0).to(tl.float32)
    w = tl.load(cw_ptr + chan[:, None] * KW + j[None, :], mask=n_ok[:, None] & (j[None, :] < KW), other=0.0)
    return st, w.to(tl.float32)


@triton.jit
def _conv_apply(qkv_ptr, cs_ptr, chan, n_ok, cs_stride_c, slot_raw, st, w, KW: tl.constexpr, KWP: tl.constexpr,
                SHIFT: tl.constexpr):
    """Causal conv over [state taps, x] for channels `chan`, SiLU; shifts the state if SHIFT.
    Returns (silu(conv), the window), the window for a later _shift_conv."""
    win = _window(qkv_ptr, chan, n_ok, st, KW, KWP)
    y = tl.sum(win * w, 1)
    if SHIFT:
        # Other threads of this program may still have to read those positions: all loads first.
        tl.debug_barrier()
        _shift_conv(cs_ptr, chan, n_ok, cs_stride_c, slot_raw, win, KW, KWP)
    return y / (1.0 + tl.exp(-y)), win


@triton.jit
def _window(qkv_ptr, chan, n_ok, st, KW: tl.constexpr, KWP: tl.constexpr):
    """[state taps, x] of channels `chan`: the conv's input window, fp32 [chan, KWP]."""
    j = tl.arange(0, KWP)
    x = tl.load(qkv_ptr + chan, mask=n_ok, other=0.0).to(tl.float32)
    return tl.where(j[None, :] == KW - 1, x[:, None], st)


@triton.jit
def _shift_conv(cs_ptr, chan, n_ok, cs_stride_c, slot_raw, win, KW: tl.constexpr, KWP: tl.constexpr):
    """New conv state = the window shifted left by one: tap j (1..KW-1) goes to position j-1."""
    j = tl.arange(0, KWP)
    valid = (j[None, :] * 0 + slot_raw) >= 0  # a block, not a scalar: the interpreter rejects scalar masks
    new_mask = n_ok[:, None] & (j[None, :] >= 1) & (j[None, :] < KW) & valid
    tl.store(cs_ptr + chan[:, None] * cs_stride_c + (j[None, :] - 1), win.to(cs_ptr.dtype.element_ty), mask=new_mask)


@triton.jit
def _silu_z(z_row, hv_g, rf, gf_ok, V):
    """silu(z) of value heads hv_g, whole V rows: [GP, BVF] fp32."""
    zf = tl.load(z_row + hv_g[:, None] * V + rf[None, :], mask=gf_ok, other=0.0).to(tl.float32)
    return zf / (1.0 + tl.exp(-zf))


@triton.jit
def _gdn_decode_kernel(qkv_ptr, z_ptr, a_ptr, b_ptr, cs_ptr, cw_ptr, alog_ptr, dtb_ptr, nw_ptr, s_ptr, slot_ptr,
                       out_ptr, ws_ptr, tick_ptr, q8_ptr, qs_ptr, qh_ptr, stride_qkv, stride_z, stride_ab, cs_stride_slot,
                       cs_stride_c,
                       s_stride_slot, stride_out, eps, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, KW: tl.constexpr, KWP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       NVB: tl.constexpr, BVF: tl.constexpr, GP: tl.constexpr, EARLY_S: tl.constexpr, PDL: tl.constexpr,
                       QUANT: tl.constexpr, QB: tl.constexpr):
    """QUANT: 0 none; 1 the row's FP8 codes (q8) and scale (qs); 2 those and their fp16 pairs (qh);
    3 each key head's max |out| over its output values, into qs [B, H] (gemv_fp8_quantizing).
    Tickets: [B·H] per (row, key head), then [B] per row (QUANT 1, 2)."""
    G: tl.constexpr = HV // H
    # One program id, V-block fastest, then value head, then row: a key head's programs (G value
    # heads x V-blocks) run side by side, so the last of them finds their o rows and its q / k
    # inputs still in L2, and a value head's V-blocks read adjacent halves of its state.
    pid = tl.program_id(0)
    NB = tl.num_programs(0) // (NVB * HV)
    vb = pid % NVB
    hv = (pid // NVB) % HV
    bi = pid // (NVB * HV)
    h = hv // G
    slot_raw = tl.load(slot_ptr + bi)  # the step's metadata, written before the decoder's first kernel
    slot = tl.maximum(slot_raw, 0).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    k_ok = rk < K
    v_ok = rv < V
    qkv = qkv_ptr + bi * stride_qkv
    cs = cs_ptr + slot * cs_stride_slot
    valid_k = (rk * 0 + slot_raw) >= 0
    chan_q, chan_k, chan_v = h * K + rk, H * K + h * K + rk, 2 * H * K + hv * V + rv  # conv channels
    # The recurrent and conv states and the weights are this layer's own (no kernel before this one
    # writes them): under PDL (batch 1's small V-blocks, EARLY_S) they stream while in_proj's GEMV
    # finishes, before waiting on it.
    sp = s_ptr + slot * s_stride_slot + hv * V * K + rv[:, None] * K + rk[None, :]
    smask = v_ok[:, None] & (k_ok & valid_k)[None, :]
    if EARLY_S:
        S = tl.load(sp, mask=smask, other=0.0)
    st_q, w_q = _conv_taps(cs, cw_ptr, chan_q, k_ok, cs_stride_c, slot_raw, KW, KWP)
    st_k, w_k = _conv_taps(cs, cw_ptr, chan_k, k_ok, cs_stride_c, slot_raw, KW, KWP)
    st_v, w_v = _conv_taps(cs, cw_ptr, chan_v, v_ok, cs_stride_c, slot_raw, KW, KWP)
    decay = tl.exp(tl.load(alog_ptr + hv).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + hv).to(tl.float32)
    # What the key head's last program needs for the gated norm of its G value heads' whole V rows:
    # at batch 1 every program loads it (the norm weight before the wait, z with the other inputs),
    # so that the tail after the ticket waits on one round trip, its o rows.
    rf = tl.arange(0, BVF)
    f_ok = rf < V
    rg = tl.arange(0, GP)
    hv_g = h * G + rg
    gf_ok = (rg < G)[:, None] & f_ok[None, :]
    if EARLY_S:
        nw = tl.load(nw_ptr + rf, mask=f_ok, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)  # in_proj's outputs (q/k/v, z, a, b) are complete past this point
    q, win_q = _conv_apply(qkv, cs, chan_q, k_ok, cs_stride_c, slot_raw, st_q, w_q, KW, KWP, False)
    k, win_k = _conv_apply(qkv, cs, chan_k, k_ok, cs_stride_c, slot_raw, st_k, w_k, KW, KWP, False)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * (1.0 / tl.sqrt(K * 1.0))
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    v, _ = _conv_apply(qkv, cs, chan_v, v_ok, cs_stride_c, slot_raw, st_v, w_v, KW, KWP, True)
    a = tl.load(a_ptr + bi * stride_ab + hv).to(tl.float32) + dt_bias
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    g = -decay * softplus
    bb = tl.load(b_ptr + bi * stride_ab + hv).to(tl.float32)
    beta = 1.0 / (1.0 + tl.exp(-bb))
    if EARLY_S:
        silu_z = _silu_z(z_ptr + bi * stride_z, hv_g, rf, gf_ok, V)
    # Above batch 1 (tiles loaded late) the state is read and written once a step and is far larger
    # than L2 (134 MB a layer at B = 64): loaded evict-first and stored streaming (.cs), it displaces
    # nothing there. Batch 1's early tiles keep the defaults.
    if not EARLY_S:
        S = tl.load(sp, mask=smask, other=0.0, eviction_policy="evict_first")
    S = S * tl.exp(g)
    delta = (v - tl.sum(S * k[None, :], 1)) * beta
    S = S + delta[:, None] * k[None, :]
    if EARLY_S:
        tl.store(sp, S, mask=smask)
    else:
        tl.store(sp, S, mask=smask, cache_modifier=".cs")
    o = tl.sum(S * q[None, :], 1)
    ws = ws_ptr + (bi * HV + hv) * V
    tl.store(ws + rv, o, mask=v_ok)
    # Every thread's o rows and conv reads are done (barrier) before the ticket releases them;
    # the last ticket acquires everyone else's, and the barrier after keeps its reads behind it.
    tl.debug_barrier()
    ticket = tl.atomic_add(tick_ptr + bi * H + h, 1, sem="acq_rel")
    tl.debug_barrier()
    if ticket == G * NVB - 1:
        # Every program of the key head has read the q / k conv state by now: shift it from the
        # window this program holds. Above batch 1 registers bind (a 64-row state tile; held, the
        # windows and z took the FP8-quantizing form from 128 to 149, Triton 3.6 for sm_90), so
        # there the tail loads them again.
        if not EARLY_S:
            win_q = _window(qkv, chan_q, k_ok, _conv_taps(cs, cw_ptr, chan_q, k_ok, cs_stride_c, slot_raw, KW, KWP)[0],
                            KW, KWP)
            win_k = _window(qkv, chan_k, k_ok, _conv_taps(cs, cw_ptr, chan_k, k_ok, cs_stride_c, slot_raw, KW, KWP)[0],
                            KW, KWP)
            silu_z = _silu_z(z_ptr + bi * stride_z, hv_g, rf, gf_ok, V)
            nw = tl.load(nw_ptr + rf, mask=f_ok, other=0.0).to(tl.float32)
        _shift_conv(cs, chan_q, k_ok, cs_stride_c, slot_raw, win_q, KW, KWP)
        _shift_conv(cs, chan_k, k_ok, cs_stride_c, slot_raw, win_k, KW, KWP)
        # The G value heads at once, [GP, whole V]: one round trip for their o rows.
        of = tl.load(ws_ptr + (bi * HV + hv_g)[:, None] * V + rf[None, :], mask=gf_ok, other=0.0,
                     cache_modifier=".cg")
        of = of * tl.rsqrt(tl.sum(of * of, 1) / V + eps)[:, None]
        of = of * nw[None, :] * silu_z
        valid_f = (rf * 0 + slot_raw) >= 0
        of = tl.where(valid_f[None, :], of, 0.0).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + bi * stride_out + hv_g[:, None] * V + rf[None, :], of, mask=gf_ok)
        if QUANT == 3:  # of the values as stored (masked lanes are 0)
            amax = tl.max(tl.max(tl.abs(of.to(tl.float32)), 1), 0)
        tl.atomic_xchg(tick_ptr + bi * H + h, 0)
        if QUANT == 3:
            tl.store(qs_ptr + bi * H + h, amax)
        if QUANT == 1 or QUANT == 2:  # the row's last key head quantizes the whole row
            quant_fp8_row_when_last(tick_ptr + NB * H + bi, H, out_ptr + bi * stride_out,
                                    q8_ptr + bi * HV * V, qs_ptr + bi, qh_ptr + bi * HV * V, HV * V, QB, QUANT == 2)


def _v_blocks(bsz: int, hv: int, v: int, device) -> int:
    """V-blocks per value head: at least two (a 64-row tile at 128 registers fits four programs to
    an SM, a whole 128-row one at 245 two), more until there are ~4 programs per SM, blocks of at
    least MIN_V_ROWS rows."""
    nvb = 2 if v >= 32 else 1
    while bsz * hv * nvb < 4 * sm_count(device) and v // (2 * nvb) >= MIN_V_ROWS:
        nvb *= 2
    return nvb


def gdn_decode(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, norm_weight, state, slots,
               num_k_heads: int, head_k_dim: int, head_v_dim: int, eps: float = 1e-6, out=None, num_warps: int | None = None,
               v_blocks: int | None = None, quant: str | None = None, half: bool = False,
               pdl: bool | None = None):
    """qkv [B, 2·H·K + HV·V] (in_proj_qkv output), z [B, HV·V], a, b [B, HV]; conv_state
    [slots, C, KW-1], conv_weight [C, KW]; A_log, dt_bias [HV]; norm_weight [V]; state fp32
    [slots, HV, V, K]; slots int32 [B] (negative: padding row). Updates conv_state and state
    in place; returns the gated-normed output [B, HV·V] (bf16 unless `out` says otherwise).
    v_blocks: V-blocks per value head (a power of two; default from the batch and SM count).
    quant="fp8": returns (out, (E4M3 [B, HV·V], fp32 scale [B, 1][, with half the codes' fp16
    pairs])) — quant_fp8_per_token(out, half) without its launch, what an FP8 out_proj reads.
    quant="amax": returns (out, (fp32 [B, H],)), each key head's max |out| over its values: the row's
    absmax in parts, what an FP8 out_proj that quantizes inside its GEMV reads at batch 1
    (gemv_fp8_quantizing), with no pass over the row between the two kernels. pdl: as
    splitk.use_pdl (only batch 1's small state tiles launch early, whatever it says)."""
    bsz = qkv.shape[0]
    hv = A_log.shape[0]
    H, K, V = num_k_heads, head_k_dim, head_v_dim
    kw = conv_weight.shape[-1]
    conv_weight = conv_weight.reshape(conv_weight.shape[0], kw)
    if state.dtype != torch.float32 or tuple(state.shape[1:]) != (hv, V, K) or not state.is_contiguous():
        raise ValueError(f"gdn_decode: state must be contiguous fp32 [slots, {hv}, {V}, {K}], got "
                         f"{state.dtype} {tuple(state.shape)}")
    if qkv.shape[1] != 2 * H * K + hv * V or conv_state.shape[1:] != (qkv.shape[1], kw - 1):
        raise ValueError(f"gdn_decode: qkv {tuple(qkv.shape)} / conv_state {tuple(conv_state.shape)} do not match "
                         f"H={H}, K={K}, HV={hv}, V={V}, kernel {kw}")
    if conv_state.stride(2) != 1 or a.stride(1) != 1 or b.stride() != a.stride():
        raise ValueError("gdn_decode: conv_state's last dim and a/b rows must be contiguous (same strides)")
    nvb = v_blocks or _v_blocks(bsz, hv, V, qkv.device)
    bv = triton.next_power_of_2(triton.cdiv(V, nvb))
    # o rows before the norm; tickets per (row, key head), then per row (quant)
    ws, tick = workspace(qkv.device, (bsz, hv, V), bsz * (H + 1), owner="gdn")
    out = torch.empty(bsz, hv * V, dtype=qkv.dtype, device=qkv.device) if out is None else out
    # Launched early (PDL) only where a program's state tile is small (batch 1): larger batches fill
    # the SMs with programs of ~250 registers, and waiting ones took room from the running GEMV.
    early = bv * triton.next_power_of_2(K) <= 32 * 128
    pdl = early and use_pdl(qkv.device, pdl)
    if quant not in (None, "fp8", "amax"):
        raise ValueError(f"gdn_decode: quant must be None, 'fp8' or 'amax', got {quant!r}")
    q8 = qs = qh = out
    if quant == "amax":
        qs = torch.empty(bsz, H, dtype=torch.float32, device=qkv.device)
    if quant == "fp8":
        q8 = torch.empty(bsz, hv * V, dtype=torch.float8_e4m3fn, device=qkv.device)
        qs = torch.empty(bsz, 1, dtype=torch.float32, device=qkv.device)
        qh = torch.empty(bsz, hv * V, dtype=torch.float16, device=qkv.device) if half else qs
    # 4 warps at every batch (WARPS): fastest or tied for each V-split, much faster than 8 with a
    # whole V row per program (B >= 32).
    _gdn_decode_kernel[(bsz * hv * triton.cdiv(V, bv),)](
        qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, norm_weight, state, slots, out, ws, tick,
        q8.view(torch.uint8) if quant == "fp8" else q8, qs, qh,
        qkv.stride(0), z.stride(0), a.stride(0), conv_state.stride(0), conv_state.stride(1), state.stride(0),
        out.stride(0), eps, H=H, HV=hv, K=K, V=V, KW=kw, KWP=triton.next_power_of_2(kw),
        BK=triton.next_power_of_2(K), BV=bv, NVB=triton.cdiv(V, bv), BVF=triton.next_power_of_2(V),
        GP=triton.next_power_of_2(hv // H), EARLY_S=early, QUANT={None: 0, "fp8": 2 if half else 1, "amax": 3}[quant],
        QB=min(4096, triton.next_power_of_2(hv * V)),
        num_warps=num_warps or WARPS, PDL=pdl, launch_pdl=pdl)
    if quant is None:
        return out
    if quant == "amax":  # a 1-tuple, like the other forms a Linear's x_q takes
        return out, (qs,)
    return out, ((q8, qs, qh) if half else (q8, qs))

