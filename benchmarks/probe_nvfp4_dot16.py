"""Probe (#54, #55): can an NVFP4 GEMV at M = 2…16 beat cuBLAS over the dequantized BF16 weight?

    python benchmarks/probe_nvfp4_dot16.py --out probe_nvfp4_dot16.json   # GPU: check, then time
    TRITON_INTERPRET=1 python benchmarks/probe_nvfp4_dot16.py --check     # CPU: the kernel's logic only

The question: mixed's NVFP4 MLPs run on cuBLAS over BF16 weights above batch 1 (the speculative
verify's k + 1 rows, the 8–16-row decode batches at the p90 SLO), reading 3.6× their packed bytes;
gemv_nvfp4's tensor-core form lost to it (17–23 % of copy at M = 4: its decode goes through fp32,
a bf16 rounding and a transposed weight operand). This form keeps every weight exact in fp16 and
never leaves it: nibble -> E2M1·2⁻¹⁴ in fp16 (half2.e2m1_times_2m14), times the block scale ·2⁷ in
fp16 (E4M3 converts exactly; the product has ≤ 6 significant bits and lies in [2⁻¹⁷, 2688], so it
is exact), and the decoded tile is the dot's *first* operand as it stands ([BN, BK] · xᵀ [BK, 16]:
the output tile is yᵀ, transposed once in the epilogue). The activations come in fp16, each row
divided by a power of two that keeps it below fp16's range (the producer would write them so; here
made once, outside the timing, as the batch-1 path's activation pairs are). y = acc · 2⁷ / global ·
row scale: the products Σ x·E2M1·s are exact, so the result differs from the simulation's
(weights rounded to bf16 after the division by the global scale) by ≤ 2⁻⁹ of a weight, as the
batch-1 kernel's does.

Answer goes to docs/bench-log/spec.md; the probe goes once answered (if this form wins, it replaces
gemv_nvfp4's dot form, whose weight and scale loads it copies).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ocriaquant.quant import nvfp4  # noqa: E402
from ocriaquant.runtime.kernels.gemv_nvfp4 import gemv_nvfp4  # noqa: E402
from ocriaquant.runtime.kernels.half2 import e2m1_times_2m14  # noqa: E402
from ocriaquant.runtime.kernels.reference import gemv_nvfp4_ref  # noqa: E402
from ocriaquant.runtime.kernels.rounding import e4m3_value  # noqa: E402
from ocriaquant.runtime.kernels.splitk import interpreted, launch_plan, store_or_reduce  # noqa: E402

FP16_ROW_MAX = 16384.0  # a row's largest |x| after its power-of-two scale: far from fp16's 65504


@triton.jit
def _dot16_kernel(x_ptr, xs_ptr, w_ptr, sc_ptr, sc8_ptr, gs_ptr, y_ptr, ws_ptr, tick_ptr, M, N, K, stride_xm,
                  stride_wn, stride_sn, stride_ym, K_PER_SPLIT, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, SPLIT_K: tl.constexpr, INTERPRET: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rkh = tl.arange(0, BK // 2)
    rks = tl.arange(0, BK // 16)
    rk = tl.arange(0, BK)
    nmask = rn < N
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BK):
        kh = k0 // 2 + rkh
        p = tl.load(w_ptr + rn[:, None] * stride_wn + kh[None, :], mask=nmask[:, None] & (kh[None, :] < K // 2),
                    other=0, eviction_policy="evict_first").to(tl.int16)
        ksb = k0 // 16 + rks
        s_off = rn[:, None] * stride_sn + ksb[None, :]
        s_mask = nmask[:, None] & (ksb[None, :] < K // 16)
        if INTERPRET:  # the interpreter's E4M3 conversion is unreliable (rounding.py)
            s = e4m3_value(tl.load(sc_ptr + s_off, mask=s_mask, other=0).to(tl.int32)).to(tl.float16)
        else:
            s = tl.load(sc8_ptr + s_off, mask=s_mask, other=0.0, eviction_policy="evict_first").to(tl.float16)
        lo = e2m1_times_2m14(p & 15)
        hi = e2m1_times_2m14((p >> 4) & 15)
        w = tl.reshape(tl.join(lo, hi), (BN, BK // 16, 16))
        w = tl.reshape((w * (s * 128.0)[:, :, None]).to(tl.float16), (BN, BK))  # E2M1 · s · 2⁻⁷, exact in fp16
        ks = k0 + rk
        xt = tl.load(x_ptr + rm[None, :] * stride_xm + ks[:, None], mask=(rm[None, :] < M) & (ks[:, None] < K),
                     other=0.0)
        if INTERPRET:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc)
        else:
            acc = tl.dot(w, xt, acc)
    xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    acc = acc * (128.0 / tl.load(gs_ptr)) * xs[None, :]
    store_or_reduce(tl.trans(acc), y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, M, N, stride_ym, BM, BN, SPLIT_K)


def fp16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [M, K] -> (fp16 [M, K], fp32 [M]): each row divided by the power of two that brings its
    largest |x| to at most FP16_ROW_MAX (1 where it already is), exactly."""
    amax = x.float().abs().amax(dim=1).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP16_ROW_MAX)).clamp_min(0))
    return (x.float() / scale[:, None]).half().contiguous(), scale.float().contiguous()


def gemv_nvfp4_dot16(x16: torch.Tensor, xs: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                     w_global_scale: torch.Tensor, out: torch.Tensor | None = None, block_n: int = 64,
                     block_k: int = 128, split_k: int | None = None, num_warps: int = 4,
                     num_stages: int = 4) -> torch.Tensor:
    m, k = x16.shape
    n = w_packed.shape[0]
    bm, grid, k_per, out, ws, tick = launch_plan(m, n, k, block_n, block_k, w_packed.device, split_k, out)
    _dot16_kernel[grid](x16, xs, w_packed, w_scale.view(torch.uint8), w_scale, w_global_scale.reshape(1).float(),
                        out, ws, tick, m, n, k, x16.stride(0), w_packed.stride(0), w_scale.stride(0), out.stride(0),
                        k_per, BM=bm, BN=block_n, BK=block_k, SPLIT_K=grid[1], num_warps=num_warps,
                        num_stages=num_stages, INTERPRET=interpreted())
    return out


def exact_ref(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """float64: x times E2M1 · s / global, no bf16 rounding of the weight (what this form computes)."""
    vals = nvfp4.unpack(w_packed, torch.float32).double().reshape(w_packed.shape[0], -1, 16)
    w = (vals * w_scale.double().unsqueeze(-1)).flatten(1) / gs.double()
    return x.double() @ w.T


def check(device: str) -> list[dict]:
    rows = []
    torch.manual_seed(0)
    for n, k, m, bn, bk in ((64, 256, 1, 32, 64), (96, 256, 3, 32, 128), (80, 512, 4, 64, 64), (64, 128, 16, 32, 64),
                            (40, 256, 9, 16, 64)):
        w = torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5
        packed, scales, gs = nvfp4.quantize_weight(w)
        x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        x[0, 3] = 3e5  # past fp16's range: the row's power-of-two scale must take it
        x16, xs = fp16_rows(x)
        y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
        gemv_nvfp4_dot16(x16, xs, packed, scales, gs, out=y, block_n=bn, block_k=bk, split_k=2 if m % 2 else None)
        want = exact_ref(x, packed, scales, gs)
        err_exact = float(((y.double() - want).abs().amax(1) / want.abs().amax(1)).max())  # row by row
        err_sim = float((y.double() - gemv_nvfp4_ref(x, packed, scales, gs)).norm() / want.norm())
        ok = bool(torch.isfinite(y).all()) and err_exact <= 2**-7 and err_sim <= 1e-2  # one bf16 ulp: the interpreter truncates
        rows.append(dict(n=n, k=k, m=m, err_exact_max=err_exact, err_vs_simulation=err_sim, ok=ok))
        print(f"check N={n} K={k} M={m}: max err {err_exact:.1e} of a row's largest output (one bf16 ulp at most), "
              f"{err_sim:.1e} against the simulation's bf16 weights: {'ok' if ok else 'WRONG'}")
    if not all(r["ok"] for r in rows):
        raise SystemExit("dot16 wrong")
    return rows


def timing(ms: list[int], device: str = "cuda", on_row=None) -> list[dict]:
    from kernels_harness import FUSED, checked_timer, graph_time_us, time_tiles, weight_copies

    from ocriaquant.bench import copy_bandwidth

    bw = copy_bandwidth(torch.device(device))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    for name, (n, k) in FUSED.items():
        if name == "lm_head":
            continue
        W, _, WP, gs = weight_copies(n, k)
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            x16, xs = fp16_rows(x)
            outs = [torch.empty(m, n, dtype=torch.bfloat16, device=device) for _ in W]
            nbytes = n * k // 2 + n * k // 16 + m * k * 2 + m * n * 2
            pct = lambda us: round(100 * nbytes / (us * 1e-6) / bw, 1)  # noqa: E731
            cublas = graph_time_us([lambda i=i: torch.mm(x, W[i].T, out=outs[i]) for i in range(len(W))])
            timed = checked_timer(outs, gemv_nvfp4_ref(x, WP[0][0], WP[0][1], gs).float(), f"{name} M={m}")
            old = timed(lambda i: gemv_nvfp4(x, WP[i][0], WP[i][1], gs, out=outs[i], path="dot"), "dot")
            cands = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=st, split_k=None)
                     for bn, bk, nw, st in ((64, 128, 4, 4), (32, 128, 4, 4), (64, 256, 4, 3), (128, 128, 8, 4),
                                            (64, 64, 4, 6), (128, 64, 4, 4), (32, 256, 4, 3), (128, 256, 8, 3),
                                            (16, 256, 4, 4))]
            tried = time_tiles(cands, lambda i, c: gemv_nvfp4_dot16(x16, xs, WP[i][0], WP[i][1], gs, out=outs[i], **c),
                               timed, pct, print)
            best = min(tried, key=lambda t: t["us"]) if tried else None
            prep = graph_time_us([lambda: fp16_rows(x)] * 64)  # what a producer kernel would write instead
            row = dict(shape=name, n=n, k=k, m=m, cublas_bf16_us=round(cublas, 2), cublas_pct=pct(cublas),
                       fp16_rows_torch_us=round(prep, 2),
                       old_dot_us=round(old, 2), old_dot_pct=pct(old), dot16=tried,
                       best=best, best_vs_cublas=round(cublas / best["us"], 3) if best else None)
            rows.append(row)
            if on_row:
                on_row(rows)
            got = (f"{best['us']} µs ({best['pct']} %, tile {best['block_n']}x{best['block_k']}, {best['num_warps']} warps, "
                   f"{best['num_stages']} stages): {row['best_vs_cublas']}x cuBLAS") if best else "no tile ran"
            print(f"{name} M={m}: cuBLAS {cublas:.1f} µs ({pct(cublas)} %), old dot {old:.1f} µs, dot16 {got}; "
                  f"activations to fp16 rows in torch {prep:.1f} µs")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="check only (on the CPU under TRITON_INTERPRET=1)")
    ap.add_argument("--batches", default="2,4,8,16")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "check": check(device)}
    def save(rows=None):  # after every row: a call cut at its time limit keeps what it timed
        if rows is not None:
            report["timing"] = rows
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))

    save()
    if not args.check and device == "cuda":
        save(timing([int(v) for v in args.batches.split(",")], on_row=save))


if __name__ == "__main__":
    main()
