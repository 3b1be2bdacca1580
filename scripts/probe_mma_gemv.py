"""Probe: an FP8 GEMV on warp-level tensor-core MMAs fed straight from registers, against the runtime's FP8
GEMV (gemv_fp8 as QuantLinear launches it: the batch-1 CUDA-core kernel at its tiles.py tile, the wgmma
form above batch 1) on the 4B's shapes, in one run. Each candidate is checked against gemv_fp8_ref on a
NaN-poisoned output (relative error <= 1e-2) and timed as bench_kernels.py times (graphs of >= 64
launches cycling weight copies past L2); % = (weights + scales + activations + output) / time / copy
bandwidth. Not adopted: at best level with the runtime's kernels (BENCHMARKS.md, session 26).

    python scripts/probe_mma_gemv.py --batches 1,8,16 --out mma.json

The kernel. The batch-1 GEMVs spend ~1.4 (FP8) instructions a weight on conversions and paired fp16
FMAs (half2.py); the wgmma form above batch 1 pays ~2 µs a launch for its shared-memory pipeline
(session 25). Here each lane loads, 16 bytes at a time, exactly its A fragments of two
`mma.sync.m16n8k16` (fp16 × fp16 -> fp32) from a weight re-laid once (pack_fp8): per 32-wide K-step a
warp turns 512 weights into products with one load, eight E4M3 -> fp16 pair conversions a lane and
two MMAs, no shared memory. (Hopper has no E4M3 mma.sync: ptxas lowers `mma...e4m3` to the same
conversions, two HMMAs and four FADDs a call, so the kernel converts and multiplies in fp16 itself.)

Lane model. The kernel works on tensors [..., 32·W] whose last dim is one element a thread (lane =
i % 32, warp = i // 32: Triton's default layout for them, checked in the TTGIR) and whose leading
dims live in registers. Every load that feeds an MMA is inline PTX: a Triton load could be
vectorised into a layout with several elements a thread, and the warp-collective MMA would then
multiply the wrong values.

Fragments of m16n8k16 (lane = 4g + t): A a0 = (row g, k 2t, 2t+1), a1 = (row g+8, same k), a2 / a3
the same rows at k + 8; B b0 = (k 2t, 2t+1; column g), b1 = k + 8; C c0, c1 = (row g, columns 2t,
2t+1), c2, c3 = row g+8. The MMA's K slots (2t, 2t+1, 2t+8, 2t+9) hold the weights and activations
of k = 4t … 4t+3 of its 16: a sum over K is the same in any order, and with this one a lane's four
weights of a row, and its four activations, are one 32-bit word each. B's columns are 8 tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from bench_kernels import FUSED, checked_timer, weight_copies  # scripts/ is on sys.path when run as a script

from ocriaquant.bench import copy_bandwidth
from ocriaquant.runtime.kernels import gemv_fp8, gemv_fp8_ref, quant_fp8_per_token
from ocriaquant.runtime.kernels.splitk import use_pdl, wait_for_inputs, workspace
from ocriaquant.runtime.kernels.tiles import m1_tile

# Two E4M3 codes (16 bits) -> an fp16 pair: exact, E4M3 ⊂ fp16.
_CVT_A_PTX = tl.constexpr("{\n.reg .b16 l, h;\n"
                          "mov.b32 {l, h}, $8; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $2, h;\n"
                          "mov.b32 {l, h}, $9; cvt.rn.f16x2.e4m3x2 $1, l; cvt.rn.f16x2.e4m3x2 $3, h;\n"
                          "mov.b32 {l, h}, $10; cvt.rn.f16x2.e4m3x2 $4, l; cvt.rn.f16x2.e4m3x2 $6, h;\n"
                          "mov.b32 {l, h}, $11; cvt.rn.f16x2.e4m3x2 $5, l; cvt.rn.f16x2.e4m3x2 $7, h;\n}")
_CVT_B_PTX = tl.constexpr("{\n.reg .b16 l, h;\n"
                          "mov.b32 {l, h}, $4; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h;\n"
                          "mov.b32 {l, h}, $5; cvt.rn.f16x2.e4m3x2 $2, l; cvt.rn.f16x2.e4m3x2 $3, h;\n}")
# One 32-wide K-step: two m16n8k16 fp16 MMAs (fp32 accumulate), A $4..$11, B $12..$15, C $16..$19.
_MMA2_PTX = tl.constexpr(
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$12, $13}, "
    "{$16, $17, $18, $19};\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$8, $9, $10, $11}, {$14, $15}, "
    "{$0, $1, $2, $3};")


@triton.jit
def _ld_v4(ptr):
    """The four int32 words at each 16-byte aligned ptr, one ld.global.v4 (not pure: it must
    stay where it is relative to the PDL wait)."""
    a = ptr.to(tl.int64, bitcast=True)
    return tl.inline_asm_elementwise("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [a],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)


@triton.jit
def _ld_v2_if(ptr, ok):
    """Two int32 words at each 8-byte aligned ptr where ok (int32, nonzero); zeros elsewhere, with no memory
    request (the lanes of tokens past M)."""
    a = ptr.to(tl.int64, bitcast=True)
    return tl.inline_asm_elementwise("{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\n"
                                     "@p ld.global.v2.b32 {$0, $1}, [$3];\n}", "=r,=r,r,l", [ok, a],
                                     dtype=(tl.int32, tl.int32), is_pure=False, pack=1)


@triton.jit
def _ld_b32_if(ptr, ok):
    """One int32 word at each ptr where ok, as _ld_v2_if."""
    a = ptr.to(tl.int64, bitcast=True)
    return tl.inline_asm_elementwise("{\n.reg .pred p;\nsetp.ne.b32 p, $1, 0;\nmov.b32 $0, 0;\n"
                                     "@p ld.global.b32 $0, [$2];\n}", "=r,r,l", [ok, a], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _cvt_a(w0, w1, w2, w3):
    """A K-step's four weight words (pack_fp8) -> the two MMAs' A fragments, fp16 pairs."""
    return tl.inline_asm_elementwise(_CVT_A_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [w0, w1, w2, w3],
                                     dtype=(tl.int32,) * 8, is_pure=True, pack=1)


@triton.jit
def _cvt_b(x0, x1):
    """A K-step's two activation words (codes k0+4t.., k0+16+4t..) -> the two MMAs' B fragments."""
    return tl.inline_asm_elementwise(_CVT_B_PTX, "=r,=r,=r,=r,r,r", [x0, x1], dtype=(tl.int32,) * 4, is_pure=True,
                                     pack=1)


@triton.jit
def _mma2(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, c0, c1, c2, c3):
    return tl.inline_asm_elementwise(_MMA2_PTX, "=f,=f,=f,=f,r,r,r,r,r,r,r,r,r,r,r,r,f,f,f,f",
                                     [a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, c0, c1, c2, c3],
                                     dtype=(tl.float32,) * 4, is_pure=True, pack=1)


@triton.jit
def _kstep(w0, w1, w2, w3, x_lane, x_ok, ks, c0, c1, c2, c3, HALF: tl.constexpr):
    """One 32-wide K-step of every row group and token tile: B from the activations at K-step ks,
    A from the weight words, two MMAs into c."""
    if HALF:
        b0, b1 = _ld_v2_if(x_lane + ks * 16, x_ok)
        b2, b3 = _ld_v2_if(x_lane + ks * 16 + 8, x_ok)
    else:
        b0, b1, b2, b3 = _cvt_b(_ld_b32_if(x_lane + ks * 8, x_ok), _ld_b32_if(x_lane + ks * 8 + 4, x_ok))
    a0, a1, a2, a3, a4, a5, a6, a7 = _cvt_a(w0, w1, w2, w3)
    return _mma2(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, c0, c1, c2, c3)


@triton.jit
def _fp8_kernel(wf_ptr, x_ptr, xs_ptr, wsc_ptr, y_ptr, ws_ptr, tick_ptr, M, N, K, stride_xw, stride_ym, KS_PER,
                ROUNDS: tl.constexpr,
                R: tl.constexpr, NT: tl.constexpr, U: tl.constexpr, W: tl.constexpr, SPLIT_K: tl.constexpr,
                PDL: tl.constexpr, HALF: tl.constexpr):
    """HALF: x is fp16 [M, K] (the codes' values × 2^-8, quant_fp8_per_token(half=True)), read as
    ready B fragments (k0+4t … +3 of a row are the pair words (2t, 2t+1), (2t+8, 2t+9) of the MMA's
    K order, the order pack_fp8 gives A too); else E4M3 codes converted here."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    i = tl.arange(0, 32 * W)
    lane = (i % 32)[None, None, None, :]
    warp = (i // 32)[None, None, None, :]
    g = lane // 4
    t = lane % 4
    ks_total = K // 32
    rg = tl.minimum(pid_n * R + tl.arange(0, R)[:, None, None, None], N // 16 - 1)
    uu = tl.arange(0, U)[None, None, :, None]
    tok = tl.arange(0, NT)[None, :, None, None] * 8 + g
    tok_ok = tok < M
    x_ok = tok_ok.to(tl.int32)  # lanes of tokens past M load nothing (a predicated load, no select)
    w_lane = wf_ptr + (rg * ks_total * 32 + lane) * 4          # [R, 1, 1, L]
    x_lane = x_ptr + tl.where(tok_ok, tok, 0) * stride_xw
    if HALF:  # int32 words of fp16 pairs: k0 + 4t is word k0/2 + 2t
        x_lane += 2 * t
    else:     # int32 words of four codes
        x_lane += t
    ks0 = pid_k * KS_PER + uu * W + warp                        # [1, 1, U, L]
    w0, w1, w2, w3 = _ld_v4(w_lane + ks0 * 128)
    wait_for_inputs(PDL)
    zero = tl.zeros((R, NT, U, 32 * W), dtype=tl.float32)
    if ROUNDS == 1:  # every weight load of the CTA issued before its first MMA
        c0, c1, c2, c3 = _kstep(w0, w1, w2, w3, x_lane, x_ok, ks0, zero, zero, zero, zero, HALF)
    else:  # a round's loads issued before the MMAs of the round before
        c0, c1, c2, c3 = zero, zero, zero, zero
        for it in range(ROUNDS):
            ks = ks0 + it * (U * W)
            nxt = ks + tl.where(it + 1 < ROUNDS, U * W, 0)  # the last round reloads its own (L1) tile
            n0, n1, n2, n3 = _ld_v4(w_lane + nxt * 128)
            c0, c1, c2, c3 = _kstep(w0, w1, w2, w3, x_lane, x_ok, ks, c0, c1, c2, c3, HALF)
            w0, w1, w2, w3 = n0, n1, n2, n3
    # lane (g, t) of row group r, token tile n: c0 (row g, token 2t), c1 (g, 2t+1), c2 / c3 rows g+8
    # lane (g, t) of row group r, token tile n: c0 (row g, token 2t), c1 (g, 2t+1), c2 / c3 rows g+8.
    # Each lane stores its own four values (a tile assembled by join / permute cost 47 µs a launch at
    # 8 token tiles under Triton 3.6); splits meet in the workspace, the last CTA of a row block adds them.
    v0 = tl.sum(tl.reshape(tl.sum(c0, 2), (R, NT, W, 32)), 2)
    v1 = tl.sum(tl.reshape(tl.sum(c1, 2), (R, NT, W, 32)), 2)
    v2 = tl.sum(tl.reshape(tl.sum(c2, 2), (R, NT, W, 32)), 2)
    v3 = tl.sum(tl.reshape(tl.sum(c3, 2), (R, NT, W, 32)), 2)
    l32 = tl.arange(0, 32)[None, None, :]
    row = (pid_n * R + tl.arange(0, R)[:, None, None]) * 16 + l32 // 4           # [R, 1, 32]
    tok = tl.arange(0, NT)[None, :, None] * 8 + 2 * (l32 % 4)                    # [1, NT, 32]
    wsc0 = tl.load(wsc_ptr + row, mask=row < N, other=0.0)
    wsc1 = tl.load(wsc_ptr + row + 8, mask=row + 8 < N, other=0.0)
    xsc0 = tl.load(xs_ptr + tok, mask=tok < M, other=0.0)
    xsc1 = tl.load(xs_ptr + tok + 1, mask=tok + 1 < M, other=0.0)
    if HALF:
        xsc0 = xsc0 * 256.0
        xsc1 = xsc1 * 256.0
    v0 = v0 * wsc0 * xsc0
    v1 = v1 * wsc0 * xsc1
    v2 = v2 * wsc1 * xsc0
    v3 = v3 * wsc1 * xsc1
    m0 = (tok < M) & (row < N)
    m1 = (tok + 1 < M) & (row < N)
    m2 = (tok < M) & (row + 8 < N)
    m3 = (tok + 1 < M) & (row + 8 < N)
    o0 = tok * N + row
    if SPLIT_K == 1:
        yp = y_ptr + tok * stride_ym + row
        tl.store(yp, v0.to(y_ptr.dtype.element_ty), mask=m0)
        tl.store(yp + stride_ym, v1.to(y_ptr.dtype.element_ty), mask=m1)
        tl.store(yp + 8, v2.to(y_ptr.dtype.element_ty), mask=m2)
        tl.store(yp + stride_ym + 8, v3.to(y_ptr.dtype.element_ty), mask=m3)
    else:
        wp = ws_ptr + o0
        part = pid_k * (8 * NT) * N
        tl.store(wp + part, v0, mask=m0)
        tl.store(wp + part + N, v1, mask=m1)
        tl.store(wp + part + 8, v2, mask=m2)
        tl.store(wp + part + N + 8, v3, mask=m3)
        tl.debug_barrier()  # as splitk.store_or_reduce: every partial written before the ticket releases them
        ticket = tl.atomic_add(tick_ptr + pid_n, 1, sem="acq_rel")
        tl.debug_barrier()
        if ticket == SPLIT_K - 1:
            t0 = tl.zeros_like(v0)
            t1 = tl.zeros_like(v0)
            t2 = tl.zeros_like(v0)
            t3 = tl.zeros_like(v0)
            for sp in range(SPLIT_K):
                q = wp + sp * (8 * NT) * N
                t0 += tl.load(q, mask=m0, other=0.0, cache_modifier=".cg")
                t1 += tl.load(q + N, mask=m1, other=0.0, cache_modifier=".cg")
                t2 += tl.load(q + 8, mask=m2, other=0.0, cache_modifier=".cg")
                t3 += tl.load(q + N + 8, mask=m3, other=0.0, cache_modifier=".cg")
            yp = y_ptr + tok * stride_ym + row
            tl.store(yp, t0.to(y_ptr.dtype.element_ty), mask=m0)
            tl.store(yp + stride_ym, t1.to(y_ptr.dtype.element_ty), mask=m1)
            tl.store(yp + 8, t2.to(y_ptr.dtype.element_ty), mask=m2)
            tl.store(yp + stride_ym + 8, t3.to(y_ptr.dtype.element_ty), mask=m3)
            tl.atomic_xchg(tick_ptr + pid_n, 0)


def pack_fp8(w_q: torch.Tensor) -> torch.Tensor:
    """E4M3 weight [N, K] (N a multiple of 16, K of 32) -> int32 [N/16, K/32, 32, 4]: for each
    16-row group and 32-wide K-step, lane 4g + t's A fragment (a0..a3, 4 codes each, lowest k in
    the lowest byte), what one 16-byte load per lane gives _fp8_kernel."""
    n, k = w_q.shape
    if n % 16 or k % 32:
        raise ValueError(f"gemv_mma.pack_fp8: N must be a multiple of 16 and K of 32, got {tuple(w_q.shape)}")
    b = w_q.contiguous().view(torch.uint8).view(n // 16, 2, 8, k // 32, 2, 4, 4)  # [rg, h, g, ks, kh, t, j]
    return b.permute(0, 3, 2, 5, 4, 1, 6).contiguous().view(torch.int32).view(n // 16, k // 32, 32, 4)


def gemv_fp8_mma(x_q: torch.Tensor, x_scale: torch.Tensor, w_frag: torch.Tensor, w_scale: torch.Tensor,
                 out: torch.Tensor | None = None, rows: int = 1, unroll: int = 2, num_warps: int = 4,
                 split_k: int = 1, pdl: bool | None = None, x_half: torch.Tensor | None = None) -> torch.Tensor:
    """x_q E4M3 [M, K] (M <= 64), x_scale fp32 [M, 1], w_frag from pack_fp8, w_scale [N, 1]
    -> bf16 [M, N]. rows: 16-row groups a CTA; unroll: K-steps a warp has in flight; split_k:
    CTAs along K (each a whole number of num_warps · unroll K-steps)."""
    m, k = x_q.shape
    ng, ks = w_frag.shape[0], w_frag.shape[1]
    n = ng * 16
    if ks * 32 != k or m > 64:
        raise ValueError(f"gemv_fp8_mma: x {tuple(x_q.shape)} does not match the packed weight "
                         f"{tuple(w_frag.shape)} (K={ks * 32}), or M > 64")
    per = ks // split_k
    if per * split_k != ks or per % (unroll * num_warps) or ng % rows:
        raise ValueError(f"gemv_fp8_mma: K-steps {ks} / split {split_k} not a multiple of {unroll * num_warps}, "
                         f"or {ng} row groups not a multiple of {rows}")
    nt = triton.next_power_of_2(triton.cdiv(m, 8))
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x_q.device) if out is None else out
    ws, tick = workspace(x_q.device, (split_k, 8 * nt, n), ng // rows, owner="probe_mma_gemv")  # never the runtime's
    pdl = use_pdl(x_q.device, pdl)
    xv = (x_half if x_half is not None else x_q).view(torch.int32)
    _fp8_kernel[(ng // rows, split_k)](w_frag, xv, x_scale.reshape(-1).float(), w_scale.reshape(-1).float(), out, ws,
                                       tick, m, n, k, xv.stride(0), out.stride(0), per, R=rows, NT=nt, U=unroll,
                                       W=num_warps, SPLIT_K=split_k, PDL=int(pdl), HALF=x_half is not None,
                                       ROUNDS=per // (unroll * num_warps),
                                       num_warps=num_warps, launch_pdl=pdl)
    return out


def candidates(n: int, k: int, m: int, sms: int) -> list[dict]:
    """gemv_fp8_mma launches worth timing at (n, k, m): row groups a CTA, K-steps in flight a warp,
    warps, and the K splits that give each warp one or two rounds of loads."""
    ng, ks = n // 16, k // 32
    nt = -(-m // 8)
    out = []
    for rows in (1, 2):
        if ng % rows:
            continue
        for unroll in (4, 8, 16):
            if rows * nt * unroll > 16:  # accumulators and weight words: <= 64 registers each
                continue
            for warps in (2, 4, 8):
                step = unroll * warps
                # one or two rounds of loads a warp (more leave each round waiting on DRAM), >= half a CTA an SM
                splits = [s for s in range(1, ks + 1) if ks % s == 0 and (ks // s) % step == 0
                          and (ks // s) // step <= 2 and sms // 2 <= (ng // rows) * s <= 32 * sms]
                if not splits and ks % step == 0 and ng // rows > 32 * sms:  # the lm_head: rows alone are plenty
                    splits = [1]
                for s in sorted(splits)[:3]:
                    out.append(dict(rows=rows, unroll=unroll, num_warps=warps, split_k=s))
    return out


def probe_shape(name: str, batches: list[int], bw: float, sms: int, t0: float) -> list[dict]:
    """The rule and every candidate at each batch on FUSED[name], checked then timed (see the docstring)."""
    n, k = FUSED[name]
    _, WQ, _, _ = weight_copies(n, k)
    frags = [pack_fp8(w) for w, _ in WQ]
    scales = [s.float() for _, s in WQ]  # fp32 once, as a runtime would hold them
    rows = []
    for m in batches:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        x_q, x_s, x_h = quant_fp8_per_token(x, half=True)
        outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in WQ]
        timed = checked_timer(outs, gemv_fp8_ref(x_q, x_s, *WQ[0]), f"{name} M={m}")
        nbytes = n * k + n * 2 + m * k * 2 + m * n * 2
        pct = lambda us: round(100 * nbytes / (us * 1e-6) / bw, 1)  # noqa: E731
        kw = dict(x_half=x_h, **m1_tile("fp8", n, k)) if m == 1 else {}
        rule = timed(lambda i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i], **kw), "rule")
        tried = []
        half = m == 1  # what the runtime's producers write: fp16 values at batch 1, codes above
        for c in candidates(n, k, m, sms):
            try:
                us = timed(lambda i, c=c: gemv_fp8_mma(x_q, x_s, frags[i], scales[i], out=outs[i],
                                                       x_half=x_h if half else None, **c), c)
            except Exception as e:  # noqa: BLE001 - registers past the limit etc.: reported, not fatal
                print(f"  {c} failed: {type(e).__name__}: {str(e)[-400:]}", flush=True)
                continue
            tried.append(dict(c, half=half, us=round(us, 2), pct=pct(us)))
        tried.sort(key=lambda r: r["us"])
        rows.append(dict(shape=name, n=n, k=k, m=m, rule_us=round(rule, 2), rule_pct=pct(rule), tried=tried))
        best = tried[0] if tried else {}
        print(f"{name:18s} M={m:<3d} rule {rule:6.2f}us ({pct(rule)}%)  mma best {best.get('us')}us "
              f"({best.get('pct')}%) {best}  [{time.time() - t0:.0f}s]", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--shapes", default=",".join(FUSED), help="comma-separated names from bench_kernels.FUSED")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    t0 = time.time()
    bw = copy_bandwidth(torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {sms} SMs", flush=True)
    rows = []
    for name in args.shapes.split(","):
        rows += probe_shape(name, [int(v) for v in args.batches.split(",")], bw, sms, t0)
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(dict(bw=bw, rows=rows), indent=1))


if __name__ == "__main__":
    main()
