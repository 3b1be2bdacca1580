"""Probe: forms of the FP8 tensor-core GEMV above batch 1 that the runtime does not run, on the N = 2560
shapes where gemv_fp8 stays under #8's 60 % (BENCHMARKS.md, session 25). Every variant is checked
against gemv_fp8_ref on a NaN-poisoned output, then timed as scripts/bench_kernels.py times (graphs of
>= 64 launches cycling weight copies, so L2 serves nothing), beside the rule (gemv_fp8 as the runtime
calls it) in the same run.

    python scripts/probe_dot_forms.py --sets prefetch,tiled,prewait,stages --batches 8,32,64 --out forms.json
    python scripts/probe_dot_forms.py --sets intercept --out intercept.json

The probe kernel is gemv_dot's swapped form (64 weight rows a CTA, one wgmma warpgroup, split-K
through splitk.store_or_reduce) with these switches:
- wtma: weights and x through host TMA descriptors instead of cp.async pointer loads;
- pf: the CTA's whole weight slice asked of L2 (prefetch.global.L2) before its PDL wait;
- tiled: the weight re-laid [N/64, K/BK, 64, BK], each K-step of a CTA one contiguous 64·BK chunk;
- pre_k: the split's first pre_k weights of each row loaded into registers before the wait;
- pdl_mode: 2 lets the next kernel launch before the wait (splitk.pdl_launch's trigger-first order).
Sets: prefetch (wtma × pf × split × K-step / stages), tiled (tiled × wtma × split), prewait (pre_k ×
pdl_mode), stages (deeper pipelines, 512-wide K-steps); intercept times the rule's tiles over K at
N = 2560 (batch 1, 8, 64), the fixed cost and streaming rate of each path.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from bench_kernels import checked_timer, weight_copies  # scripts/ is on sys.path when run as a script
from triton.tools.tensor_descriptor import TensorDescriptor

from ocriaquant.bench import copy_bandwidth
from ocriaquant.runtime.kernels import gemv_fp8, gemv_fp8_ref, quant_fp8_per_token
from ocriaquant.runtime.kernels.splitk import (launch_plan, prefetch_l2, store_or_reduce, use_pdl, wait_for_inputs,
                                              workspace)

SHAPES = {"gdn_out / attn_o": (2560, 4096), "mlp_down": (2560, 9216)}


@triton.jit
def _probe_kernel(x_desc, xs_ptr, w_desc, w_ptr, wsc_ptr, y_ptr, ws_ptr, tick_ptr, M, N, K, stride_wn, stride_ym,
                  K_PER_SPLIT, x_ptr, stride_xm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  SPLIT_K: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr, PF: tl.constexpr,
                  WTMA: tl.constexpr, TILED: tl.constexpr, PRE_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    wsc = tl.load(wsc_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    if PF:  # the whole slice, one request per 128-byte line
        rl = tl.arange(0, BK // 128)
        for k0 in range(k_start, k_end, BK):
            prefetch_l2(w_ptr + rn[:, None] * stride_wn + k0 + rl[None, :] * 128)
    if PRE_K > 0:
        rp = tl.arange(0, PRE_K)
        w_pre = tl.load(w_ptr + rn[:, None] * stride_wn + (k_start + rp)[None, :])
    wait_for_inputs(PDL)
    xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if PRE_K > 0:
        x_pre = tl.load(x_ptr + rm[:, None] * stride_xm + (k_start + rp)[None, :], mask=(rm < M)[:, None], other=0.0)
        acc = tl.dot(w_pre, tl.trans(x_pre), acc)
    for k0 in tl.range(k_start + PRE_K, k_end, BK, num_stages=STAGES):
        if TILED and WTMA:
            w = w_desc.load([(pid_n * (K // BK) + k0 // BK) * BN, 0])
        elif TILED:
            w = tl.load(w_ptr + ((pid_n * (K // BK) + k0 // BK) * BN + tl.arange(0, BN))[:, None] * BK + rk[None, :],
                        eviction_policy="evict_first")
        elif WTMA:
            w = w_desc.load([pid_n * BN, k0])
        else:
            w = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 + rk)[None, :], eviction_policy="evict_first")
        if WTMA:
            x = x_desc.load([0, k0])
        else:
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=(rm < M)[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    acc = acc * wsc[:, None] * xs[None, :]
    store_or_reduce(tl.trans(acc), y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, M, N, stride_ym, BM, BN, SPLIT_K)


def tiled_weight(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """[N, K] -> [N/bn · K/bk · bn, bk]: tile (n-tile, k-step) as one contiguous bn × bk chunk."""
    n, k = w.shape
    return w.view(n // bn, bn, k // bk, bk).permute(0, 2, 1, 3).contiguous().view(n * k // bk, bk)


def probe_gemv(x_q, x_s, w_q, w_s, out, w_src, block_n=64, block_k=256, split_k=1, num_stages=6, pf=0, wtma=0,
               tiled=0, pre_k=0, pdl_mode=1):
    """The probe kernel on x_q [M, K] (E4M3, x_s [M, 1]) and w_q [N, K] (w_src: w_q, or tiled_weight(w_q)). On
    the CPU (the interpreter: tests) without PDL and without pf, whose prefetch is PTX."""
    m, k = x_q.shape
    pdl = use_pdl(x_q.device, None)
    n = w_q.shape[0]
    bm, grid, k_per, out, _, _ = launch_plan(m, n, k, block_n, block_k, x_q.device, split_k, out)
    ws, tick = workspace(x_q.device, (grid[1], bm, n), grid[0], owner="probe_dot_forms")  # never the runtime's
    x_desc = TensorDescriptor.from_tensor(x_q, [bm, block_k])
    w_desc = TensorDescriptor.from_tensor(w_src, [block_n, block_k])
    _probe_kernel[grid](x_desc, x_s.reshape(-1), w_desc, w_src, w_s.reshape(-1), out, ws, tick, m, n, k, w_q.stride(0),
                        out.stride(0), k_per, x_q, x_q.stride(0), BM=bm, BN=block_n, BK=block_k, SPLIT_K=grid[1],
                        PDL=pdl_mode if pdl else 0, STAGES=num_stages, PF=pf and pdl, WTMA=wtma, TILED=tiled,
                        PRE_K=pre_k, num_warps=4, launch_pdl=pdl)
    return out


def candidates(name: str, k: int, bm: int) -> list[dict]:
    steps = ((128, 8), (256, 4), (256, 6))
    if name == "prefetch":
        grid = [dict(wtma=wt, pf=pf, split_k=sp, block_k=bk, num_stages=st)
                for wt, pf, sp, (bk, st) in itertools.product((1, 0), (0, 1), (1, 2, 3, 4), steps)]
    elif name == "tiled":
        grid = [dict(tiled=td, wtma=wt, split_k=sp, block_k=bk, num_stages=st)
                for td, wt, sp, (bk, st) in itertools.product((1, 0), (1, 0), (1, 2, 3), steps)
                if td or (not wt and sp != 2)]
    elif name == "prewait":
        grid = [dict(wtma=wt, split_k=sp, block_k=bk, num_stages=st, pre_k=pre, pdl_mode=pm)
                for wt, sp, (bk, st), pre, pm in itertools.product((1, 0), (1, 3), ((256, 6), (128, 8)), (0, 512, 1024),
                                                                     (1, 2))]
    elif name == "stages":
        deep = ((256, 6), (256, 8), (256, 10), (256, 12), (512, 4), (512, 5), (512, 6), (128, 8), (128, 12), (128, 16))
        grid = [dict(wtma=wt, split_k=sp, block_k=bk, num_stages=st)
                for wt, sp, (bk, st) in itertools.product((0, 1), (1, 2, 3), deep) if sp != 2 or k == 4096]
    else:
        raise SystemExit(f"unknown set {name!r}: prefetch, tiled, prewait, stages or intercept")
    # every split at least two K-steps past what is loaded before the wait; shared memory within the H200's
    return [c for c in grid if k // c["split_k"] >= c.get("pre_k", 0) + 2 * c["block_k"]
            and (64 + bm) * c["block_k"] * c["num_stages"] <= 225 * 1024]


def probe_forms(sets: list[str], batches: list[int], bw: float, log) -> list:
    rows = []
    for name, (n, k) in SHAPES.items():
        _, WQ, _, _ = weight_copies(n, k)
        # the re-laid copies only where the tiled set asks for them (its K-steps: 128, 256)
        tiled = {bk: [tiled_weight(w, 64, bk) for w, _ in WQ] for bk in (128, 256)} if "tiled" in sets else {}
        for m in batches:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            x_q, x_s = quant_fp8_per_token(x)
            outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in WQ]
            timed = checked_timer(outs, gemv_fp8_ref(x_q, x_s, *WQ[0]), f"{name} M={m}")
            pct = lambda us: round(100 * (n * k + n * 2 + m * k * 2 + m * n * 2) / (us * 1e-6) / bw, 1)  # noqa: E731
            rule = timed(lambda i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i]), "rule")
            bm = max(16, triton.next_power_of_2(m))
            for s in sets:
                tried = []
                for c in candidates(s, k, bm):
                    src = tiled[c["block_k"]] if c.get("tiled") else [w for w, _ in WQ]
                    try:
                        us = timed(lambda i, c=c: probe_gemv(x_q, x_s, *WQ[i], outs[i], src[i], **c), c)
                    except Exception as e:  # noqa: BLE001 - e.g. shared memory past the limit: reported
                        log(f"  {s} {c} failed: {type(e).__name__}: {str(e)[:100]}")
                        continue
                    tried.append(dict(c, us=round(us, 2), pct=pct(us)))
                tried.sort(key=lambda t: t["us"])
                rows.append(dict(set=s, shape=name, n=n, k=k, m=m, rule_us=round(rule, 2), rule_pct=pct(rule),
                                 tried=tried))
                log(f"{name:18s} M={m:<3d} {s:8s} rule {rule:6.2f}us ({pct(rule)}%)  best {tried[0]['us']:6.2f}us "
                    f"({tried[0]['pct']}%) {({kk: v for kk, v in tried[0].items() if kk not in ('us', 'pct')})}")
    return rows


def probe_intercept(bw: float, log) -> list:
    """The rule's kind of tile over K at N = 2560: batch 1 whole-K rows (8 × K, unsplit), batch 8 / 64 the
    swapped dot (64 × 256, unsplit, 6 stages where K allows). time = fixed cost + K-slope."""
    rows = []
    n = 2560
    for k in (256, 512, 1024, 2048, 4096, 8192):
        _, WQ, _, _ = weight_copies(n, k)
        for m in (1, 8, 64):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            x_q, x_s, *half = quant_fp8_per_token(x, half=m == 1)
            outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(len(WQ))]
            timed = checked_timer(outs, gemv_fp8_ref(x_q, x_s, *WQ[0]), f"K={k} M={m}")
            if m == 1:
                tile = dict(block_n=8, block_k=min(k, 4096), num_warps=4, split_k=1, num_stages=1)
                us = timed(lambda i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i], x_half=half[0], **tile), "m1")
            else:
                tile = dict(block_n=64, block_k=min(256, k), num_warps=4, split_k=1, num_stages=6 if k >= 1536 else 2)
                us = timed(lambda i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i], **tile), "dot")
            pct = 100 * (n * k + n * 2 + m * k * 2 + m * n * 2) / (us * 1e-6) / bw
            rows.append(dict(k=k, m=m, us=round(us, 3), pct=round(pct, 1)))
            log(f"K={k:<5d} M={m:<3d} {us:6.2f}us ({pct:5.1f}%)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="prefetch,tiled,prewait,stages",
                    help="comma-separated: prefetch, tiled, prewait, stages (probe kernel variants), intercept")
    ap.add_argument("--batches", default="8,32,64")
    ap.add_argument("--out", type=Path, default=Path("probe_dot_forms.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    bw = copy_bandwidth(torch.device("cuda"))
    log(f"{torch.cuda.get_device_name()}: device copy {bw / 1e12:.2f} TB/s, Triton {triton.__version__}")
    sets = args.sets.split(",")
    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "triton": triton.__version__,
              "copy_tb_s": round(bw / 1e12, 3)}
    if "intercept" in sets:
        result["intercept"] = probe_intercept(bw, log)
        sets.remove("intercept")
    if sets:
        result["forms"] = probe_forms(sets, [int(v) for v in args.batches.split(",")], bw, log)
    args.out.write_text(json.dumps(result, indent=1))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
