"""Probe: FP8 above batch 1 on 2560×4096 (out_proj / o_proj), where #8's 60 % is missed at batch 32 and 64 on an H100
(57.9 / 51.0 %, BENCHMARKS.md session 36). The rule (tiles.dot_tile: 64 × 256 on 6 stages, unsplit) was chosen on
an H200 (session 23); bench_kernels' --only fp8 sweep tries splits of ½-4 × the automatic one, which on this shape
leaves out 1-3. Here: the rule beside explicit splits 1-4 and deeper or shallower pipelines, each checked against
float64 on a poisoned output and timed as bench_kernels times it (graphs of >= 64 launches over weight copies).

    python scripts/probe_fp8_dot_n2560.py --out fp8_dot_n2560.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402

from ocriaquant.bench import copy_bandwidth  # noqa: E402
from ocriaquant.runtime.kernels import gemv_fp8, gemv_fp8_ref, quant_fp8_per_token  # noqa: E402
from ocriaquant.runtime.kernels.gemv_dot import gemv_dot  # noqa: E402
from ocriaquant.runtime.kernels.tiles import dot_tile  # noqa: E402

gemv_dot_module = importlib.import_module("ocriaquant.runtime.kernels.gemv_dot")

# (block_n, block_k, num_warps, num_stages): splits
TILES = {(64, 256, 4, 6): (1, 2, 3, 4), (64, 256, 4, 4): (1, 2, 4), (64, 128, 4, 8): (1, 2, 3, 4),
         (64, 128, 4, 6): (2, 4), (128, 128, 4, 4): (1, 2, 4), (128, 256, 4, 3): (2, 4), (64, 512, 4, 3): (2, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("probe_fp8_dot_n2560.json"))
    ap.add_argument("--shape", default="2560x4096", help="N x K")
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--maxnreg", default="",
                    help="a comma list of register caps (Triton's maxnreg) to time the rule tile under")
    ap.add_argument("--rule-only", action="store_true", help="no TILES sweep: the rule and its --maxnreg caps")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_fp8_dot_n2560: needs a CUDA GPU (it times the kernel)")
    torch.manual_seed(0)
    n, k = (int(v) for v in args.shape.split("x"))
    bw = copy_bandwidth(torch.device("cuda"))
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: copy {bw / 1e12:.2f} TB/s; FP8 {n}x{k}", flush=True)
    _, WQ, _, _ = bk.weight_copies(n, k)
    rows = []
    for m in (int(v) for v in args.batches.split(",")):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        x_q, x_s = quant_fp8_per_token(x)[:2]
        outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in WQ]
        timed = bk.checked_timer(outs, gemv_fp8_ref(x_q, x_s, *WQ[0]), f"fp8 {n}x{k} M={m}")
        nbytes = n * k + n * 2 + m * k * 2 + m * n * 2  # as bench_kernels counts them
        rule = timed(lambda i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i]), "rule")
        print(f"M={m:<3d} rule {dot_tile('fp8', n, k, m)}  {rule:6.2f} us {100 * nbytes / (rule * 1e-6) / bw:5.1f} %",
              flush=True)
        rows.append(dict(m=m, tile="rule", rule_tile=dot_tile("fp8", n, k, m), us=round(rule, 2),
                         pct=round(100 * nbytes / (rule * 1e-6) / bw, 1)))
        launch = gemv_dot_module.pdl_launch
        for cap in (int(v) for v in args.maxnreg.split(",") if v):
            gemv_dot_module.pdl_launch = lambda *a, cap=cap, **kw: launch(*a, maxnreg=cap, **kw)
            try:
                us = timed(lambda i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i]), f"rule, maxnreg {cap}")
            finally:
                gemv_dot_module.pdl_launch = launch
            pct = round(100 * nbytes / (us * 1e-6) / bw, 1)
            rows.append(dict(m=m, tile="rule", maxnreg=cap, us=round(us, 2), pct=pct))
            print(f"M={m:<3d} rule, maxnreg {cap:<3d} {us:6.2f} us {pct:5.1f} %", flush=True)
        for (bn, bkk, nw, st), splits in {} if args.rule_only else TILES.items():
            for sp in splits:
                c = dict(block_n=bn, block_k=bkk, num_warps=nw, num_stages=st, split_k=sp)
                try:
                    us = timed(lambda i, c=c: gemv_dot(x_q, WQ[i][0], x_s, WQ[i][1], out=outs[i], swap=True, **c), c)
                except Exception as e:  # noqa: BLE001 - e.g. shared memory past the limit: reported, not fatal
                    print(f"  {c} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
                    continue
                pct = round(100 * nbytes / (us * 1e-6) / bw, 1)
                rows.append(dict(m=m, tile=c, us=round(us, 2), pct=pct))
                print(f"M={m:<3d} {str(c):85s} {us:6.2f} us {pct:5.1f} %", flush=True)
    args.out.write_text(json.dumps({"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "copy_tb_s": round(bw / 1e12, 3),
                                    "n": n, "k": k, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
