"""Time and peak memory of `ocriaquant export` on a Qwen3.5-4B-shaped model with a mixed plan.

    python benchmarks/bench_export.py --model /tmp/bench_calibrate/model --calib /tmp/bench_calibrate/calib \\
        --pages /tmp/bench_calibrate/pages --out /tmp/ckpt4b --json bench_export.json

The plan is the mixed one the runtime targets: NVFP4 MLPs, FP8 GDN and attention projections,
BF16 lm_head (vision and gdn_ab always BF16). Run after benchmarks/bench_calibrate.py, whose model
directory and calibration artifact it reuses. The reload-and-compare verification is skipped
here (it decodes on the CPU); the embedded model's export measures it.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from ocriaquant.artifacts import model_fingerprint
from ocriaquant.export import export
from ocriaquant.model import discover_groups, load_config, meta_model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--calib", type=Path, required=True)
    ap.add_argument("--pages", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-pages", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    groups = discover_groups(meta_model(load_config(args.model)))
    fmt = {"mlp_up": "nvfp4", "mlp_down": "nvfp4", "gdn_in": "fp8", "gdn_out": "fp8", "attn_qkv": "fp8",
           "attn_o": "fp8"}
    plan = {g.name: fmt.get(g.kind, "bf16") for g in groups if not g.always_bf16}
    plan_path = args.out.with_suffix(".plan.json")
    plan_path.write_text(json.dumps({"target": "h200", "groups": plan, "model_dir": str(args.model),
                                     "calibration": {"path": str(args.calib),
                                                     "fingerprint": model_fingerprint(args.model)}}))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.time()
    export(plan_path, args.out, pages=args.pages, max_pages=args.max_pages, force=True, verify_pages=0)
    secs = time.time() - t
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    meta = json.loads((args.out / "ocriaquant.json").read_text())
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "export_s": round(secs, 1),
           "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if cuda else None,
           "checkpoint_gb": round(size / 1e9, 2), "calibration_pages": args.max_pages,
           "formats": {f: sum(v == f for v in plan.values()) for f in ("bf16", "fp8", "nvfp4")},
           "retied_fused_units": meta["retied_fused_units"]}
    try:
        import resource
        res["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 1)
    except ImportError:
        pass
    print(json.dumps(res, indent=1))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
