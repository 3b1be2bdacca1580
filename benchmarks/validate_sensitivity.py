"""Check calibrate's sensitivity estimator against the damage it predicts, measured.

    python benchmarks/validate_sensitivity.py --calib ocriaquant-out/calib --pages 16 --out validation.json

For every quantizable layer group and every simulation kind (FP8 W8A8, NVFP4 W4A16, NVFP4
W4A4) the group alone is quantized and the held-out pages are run teacher-forced; the
measured damage is the mean token-level KL(BF16 || quantized) over target tokens. Prints the
Spearman rank correlation between estimated and measured damage over all (group, kind)
pairs, and per kind.
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ocriaquant.artifacts import input_absmax, load_calibration
from ocriaquant.calibrate import target_logits, teacher_forcing_batch
from ocriaquant.data import BUNDLED_PAGES, load_pages, select_split
from ocriaquant.model import discover_groups, load_model
from ocriaquant.quant.simulate import simulate

KIND_KEY = {"fp8": ("h200", "fp8"), "w4a16": ("h200", "nvfp4"), "w4a4": ("b200", "nvfp4")}


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        t = torch.tensor(x, dtype=torch.float64)
        return torch.argsort(torch.argsort(t)).double()

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


@torch.no_grad()
def target_logprobs(model, proc, pages, batch_size):
    out = []
    for i in range(0, len(pages), batch_size):
        chunk = pages[i: i + batch_size]
        inputs, _, tpos = teacher_forcing_batch(proc, chunk, [p.reference for p in chunk], "cpu")
        out.append(F.log_softmax(target_logits(model, inputs, tpos).float(), -1))
    return torch.cat(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--pages-dir", type=Path, default=BUNDLED_PAGES)
    ap.add_argument("--pages", type=int, default=16, help="held-out pages to measure on")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    _, sens, stats = load_calibration(args.calib)
    model, proc = load_model(args.model, dtype="fp32")
    groups = [g for g in discover_groups(model) if not g.always_bf16]
    pages = [p for p in select_split(load_pages(args.pages_dir).pages, "heldout") if p.has_reference][: args.pages]
    absmax = input_absmax(stats)
    t0 = time.time()
    base = target_logprobs(model, proc, pages, args.batch_size)
    rows = []
    for g in groups:
        for kind, (target, fmt) in KIND_KEY.items():
            with simulate(model, [(g.members, kind)], absmax):
                lp = target_logprobs(model, proc, pages, args.batch_size)
            kl = float((base.exp() * (base - lp)).sum(-1).mean())
            rows.append({"group": g.name, "kind": kind, "estimated": sens[target][g.name][fmt], "measured_kl": kl})
            print(f"{g.name:22s} {kind:6s} est {rows[-1]['estimated']:.3e}  measured {kl:.3e}", flush=True)
    result = {"pages": len(pages), "tokens": int(base.shape[0]), "seconds": round(time.time() - t0, 1),
              "spearman_all": spearman([r["estimated"] for r in rows], [r["measured_kl"] for r in rows]),
              "spearman_by_kind": {k: spearman([r["estimated"] for r in rows if r["kind"] == k],
                                                [r["measured_kl"] for r in rows if r["kind"] == k]) for k in KIND_KEY},
              "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
