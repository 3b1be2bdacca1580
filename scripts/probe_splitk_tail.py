"""Probe: what the split-K reduction at a GEMV's tail costs, and what splitk.store_or_reduce's EARLY_TICKET form
saves. Each split launch of #8's missed shapes (and the other split rules) is timed with the old tail
(OCRIAQUANT_SPLITK_EARLY=0: partial stored, acq_rel ticket, then the last CTA reads the partials) and the early one
(ticket taken after the PDL wait, the last arrival keeps its partial and reads the others', no fence), interleaved
in one process; at batch 1 also as Partials (no reduction at all: what the decode step hands add_rmsnorm), which
bounds what any in-kernel reduction can reach. Both reductions sum the splits in the same order: their outputs must
be equal bit for bit, and each is checked against float64 on a poisoned output.

    python scripts/probe_splitk_tail.py --out splitk_tail.json
    python scripts/probe_splitk_tail.py --rows "fp8 dot M=64 .*, [12].$|nvfp4 b1 2560x9216 .8, " --batches 64

Each row is compiled twice (and a third time for the Partials), ~50 s a row on a fresh H100 (session 40): --rows, a
regular expression searched in the row labels the full run prints, keeps a call to the rows it needs. The JSON is
rewritten after every row, so a call cut off at its time limit keeps the rows it finished. A row that has not
finished in --hang-s seconds ends the run with its label and the form it was timing (exit 3): a reduction that
never completes spins on the GPU until the call's limit otherwise (session 41 lost two calls so).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402

from ocriaquant.bench import copy_bandwidth  # noqa: E402
from ocriaquant.files import write_json_atomic  # noqa: E402
from ocriaquant.runtime.kernels import gemv_fp8, gemv_fp8_ref, quant_fp8_per_token, splitk  # noqa: E402
from ocriaquant.runtime.kernels.gemv_dot import gemv_dot  # noqa: E402
from ocriaquant.runtime.kernels.gemv_nvfp4 import gemv_nvfp4, gemv_nvfp4_ref, nvfp4_x_pairs  # noqa: E402
from ocriaquant.runtime.kernels.tiles import dot_tile, m1_tile  # noqa: E402

# NVFP4 batch 1 (block_n, block_k, warps, split[, maxnreg]); the first of each shape is the rule
NVFP4_B1 = {(2560, 9216): ((8, 1024, 2, 3), (8, 1024, 2, 3, 128), (16, 1024, 4, 3), (32, 1024, 8, 3),
                           (16, 1024, 4, 9), (8, 512, 2, 6), (32, 512, 4, 6)),
            (2560, 4096): ((4, 4096, 4, 1), (8, 2048, 4, 2), (4, 2048, 2, 2), (16, 1024, 4, 4), (8, 1024, 2, 4),
                           (16, 2048, 4, 2))}
# FP8 above batch 1 (block_n, block_k, warps, stages, split); the rule first
FP8_DOT = {(2560, 4096): ((64, 256, 4, 6, 1), (64, 256, 4, 6, 2), (64, 256, 4, 6, 3), (64, 256, 4, 6, 4),
                          (64, 128, 4, 8, 2), (64, 128, 4, 8, 4), (64, 256, 4, 4, 2), (64, 512, 4, 3, 2)),
           (2560, 9216): ((64, 128, 4, 8, 3), (64, 128, 4, 8, 2), (64, 128, 4, 8, 4), (64, 128, 4, 8, 6),
                          (64, 256, 4, 6, 3))}


def poisonable(outs: list, run):
    """timed_pair's call(i, early, poison=False) for run(i), which writes outs[i] (one output per weight copy):
    poison fills that output with NaN first."""
    def call(i, early, poison=False):
        if poison:
            outs[i].fill_(float("nan"))
        return run(i)
    call.copies = len(outs)
    return call


HANG_S = 150.0  # main's --hang-s


def watchdog(label: str, doing: dict) -> threading.Timer:
    """A started timer that, HANG_S seconds on, prints what the row was doing (doing["form"]) and ends the process:
    a hung kernel holds the main thread in a CUDA synchronize (which lets go of the GIL) for good."""
    def fire():
        print(f"probe_splitk_tail: {label} did not finish in {HANG_S:.0f} s, stuck in {doing['form']}: a hang",
              flush=True)
        os._exit(3)
    timer = threading.Timer(HANG_S, fire)
    timer.daemon = True
    timer.start()
    return timer


def timed_pair(call, ref, label: str, log, partials_call=None) -> dict:
    """call(i, early) for the weight copies i: each form checked (poisoned output, float64 ref), the two forms' outputs
    compared bit for bit, then timed interleaved, 3 times each (medians); under watchdog."""
    outs, default, doing = {}, splitk.SPLITK_EARLY, {"form": ""}
    timer = watchdog(label, doing)
    for early in (0, 1):
        splitk.SPLITK_EARLY = early
        doing["form"] = f"the check of the {('old', 'early')[early]} tail"
        out = call(0, early, poison=True)
        err = bk.rel(out, ref)
        if not (bool(torch.isfinite(out).all()) and err <= 1e-2):
            raise SystemExit(f"probe_splitk_tail: {label} early={early} wrong: rel err {err:.2e}")
        outs[early] = out.clone()
    same = bool(torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)))
    times = {0: [], 1: [], "partials": []}
    for _ in range(3):
        for early in (0, 1):
            splitk.SPLITK_EARLY = early
            doing["form"] = f"the timing of the {('old', 'early')[early]} tail"
            times[early].append(bk.graph_time_us(bk.cycled([lambda i=i: call(i, early) for i in range(call.copies)])))
        if partials_call is not None:
            doing["form"] = "the timing of the Partials"
            times["partials"].append(bk.graph_time_us(bk.cycled([lambda i=i: partials_call(i)
                                                                 for i in range(call.copies)])))
    splitk.SPLITK_EARLY = default
    timer.cancel()
    row = dict(old_us=round(statistics.median(times[0]), 2), early_us=round(statistics.median(times[1]), 2),
               same_bits=same, rel_err=err)
    if partials_call is not None:
        row["partials_us"] = round(statistics.median(times["partials"]), 2)
    log(f"{label:58s} old {row['old_us']:7.2f}  early {row['early_us']:7.2f}  "
        f"{'partials ' + format(row['partials_us'], '7.2f') if partials_call else '':17s} same bits {same}")
    return row


def main() -> None:
    global HANG_S
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("probe_splitk_tail.json"))
    ap.add_argument("--batches", default="8,32,64", help="FP8 tensor-core batches")
    ap.add_argument("--only", default="nvfp4,fp8_m1,fp8_dot")
    ap.add_argument("--rows", default="", help="a regular expression: only the rows whose label it matches")
    ap.add_argument("--hang-s", type=float, default=HANG_S,
                    help="seconds a row may take (its compiles included) before the run ends as hung")
    args = ap.parse_args()
    HANG_S = args.hang_s
    try:
        pick = re.compile(args.rows)
    except re.error as e:
        raise SystemExit(f"probe_splitk_tail: --rows {args.rows!r} is not a regular expression: {e}")
    if not torch.cuda.is_available():
        raise SystemExit("probe_splitk_tail: needs a CUDA GPU (it times the kernels)")
    torch.manual_seed(0)
    bw = copy_bandwidth(torch.device("cuda"))
    gpu = torch.cuda.get_device_name()
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    log(f"{gpu}: copy {bw / 1e12:.2f} TB/s")
    rows = []
    only = args.only.split(",")
    head = {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "copy_tb_s": round(bw / 1e12, 3)}

    def keep(row):
        rows.append(row)
        write_json_atomic(args.out, {**head, "rows": rows})

    def pct(us, nbytes):
        return round(100 * nbytes / (us * 1e-6) / bw, 1)

    shapes = sorted(set(NVFP4_B1) | set(FP8_DOT))
    for n, k in shapes:
        _, WQ, WP, gs = bk.weight_copies(n, k)
        nc = len(WQ)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        if "nvfp4" in only and (n, k) in NVFP4_B1:
            pairs = nvfp4_x_pairs(x)
            outs = [torch.empty(1, n, dtype=torch.bfloat16, device="cuda") for _ in range(nc)]
            ref = gemv_nvfp4_ref(x, WP[0][0], WP[0][1], gs)
            nbytes = n * k // 2 + n * k // 16 + k * 2 + n * 2
            for t in NVFP4_B1[(n, k)]:
                tile = dict(block_n=t[0], block_k=t[1], num_warps=t[2], split_k=t[3],
                            maxnreg=t[4] if len(t) > 4 else None)
                label = f"nvfp4 b1 {n}x{k} {t}"
                if not pick.search(label):
                    continue
                call = poisonable(outs, lambda i, tile=tile: gemv_nvfp4(None, WP[i][0], WP[i][1], gs, out=outs[i],
                                                                       x_pairs=pairs, m1=WP[i][2], **tile))

                def parts(i, tile=tile):
                    return gemv_nvfp4(None, WP[i][0], WP[i][1], gs, x_pairs=pairs, m1=WP[i][2], partials=True, **tile)
                row = timed_pair(call, ref, label, log, parts if t[3] > 1 else None)
                keep(dict(kind="nvfp4", m=1, n=n, k=k, tile=tile, rule=t == NVFP4_B1[(n, k)][0], **row,
                          old_pct=pct(row["old_us"], nbytes), early_pct=pct(row["early_us"], nbytes),
                          **({"partials_pct": pct(row["partials_us"], nbytes)} if "partials_us" in row else {})))
        if "fp8_m1" in only:
            x_q, x_s = quant_fp8_per_token(x)[:2]
            x_half = quant_fp8_per_token(x, half=True)[2]
            outs = [torch.empty(1, n, dtype=torch.bfloat16, device="cuda") for _ in range(nc)]
            tile = m1_tile("fp8", n, k)
            label = f"fp8 b1 {n}x{k} rule {tile}"
            if tile.get("split_k", 0) != 1 and pick.search(label):
                nbytes = n * k + n * 2 + k * 2 + n * 2
                call = poisonable(outs, lambda i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i], x_half=x_half, **tile))

                def parts(i):
                    return gemv_fp8(x_q, x_s, *WQ[i], x_half=x_half, partials=True, **tile)
                row = timed_pair(call, gemv_fp8_ref(x_q, x_s, *WQ[0]), label, log, parts)
                keep(dict(kind="fp8", m=1, n=n, k=k, tile=tile, rule=True, **row,
                          old_pct=pct(row["old_us"], nbytes), early_pct=pct(row["early_us"], nbytes),
                          partials_pct=pct(row["partials_us"], nbytes)))
        if "fp8_dot" in only and (n, k) in FP8_DOT:
            for m in (int(v) for v in args.batches.split(",")):
                xm = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                x_q, x_s = quant_fp8_per_token(xm)[:2]
                outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(nc)]
                ref = gemv_fp8_ref(x_q, x_s, *WQ[0])
                nbytes = n * k + n * 2 + m * k * 2 + m * n * 2  # as bench_kernels counts them
                rule = dot_tile("fp8", n, k, m)
                rule_t = (rule["block_n"], rule["block_k"], rule["num_warps"], rule["num_stages"], rule["split_k"])
                for t in FP8_DOT[(n, k)]:
                    tile = dict(block_n=t[0], block_k=t[1], num_warps=t[2], num_stages=t[3], split_k=t[4])
                    label = f"fp8 dot M={m} {n}x{k} {t}"
                    if not pick.search(label):
                        continue
                    call = poisonable(outs, lambda i, tile=tile: gemv_dot(x_q, WQ[i][0], x_s, WQ[i][1], out=outs[i],
                                                                          swap=True, **tile))
                    row = timed_pair(call, ref, label, log)
                    keep(dict(kind="fp8_dot", m=m, n=n, k=k, tile=tile, rule=t == rule_t, **row,
                              old_pct=pct(row["old_us"], nbytes), early_pct=pct(row["early_us"], nbytes)))
        WQ = WP = outs = None
        torch.cuda.empty_cache()
    if not rows:
        raise SystemExit(f"probe_splitk_tail: no row matched --rows {args.rows!r} under --only {args.only}")


if __name__ == "__main__":
    main()
