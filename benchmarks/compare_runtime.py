"""Greedy tokens of ocriaquant's runtime against transformers' `generate`, page by page.

    python benchmarks/compare_runtime.py [CKPT] --out runtime_vs_transformers.json

Decodes the held-out pages (bundled by default) with our runtime (continuous batching,
`--slots` at a time, so sequences of different lengths share batches and join mid-flight) and
with transformers on the same checkpoint, both BF16 (CPU by default, `--device cuda`), and counts the pages whose
tokens are identical. `--backend triton --against torch` compares our two backends instead
(issue 9: speed must cost no correctness).
"""

import argparse
import json
import time
from pathlib import Path

import torch

from ocriaquant.data import BUNDLED_PAGES, load_pages, select_split
from ocriaquant.model import load_model
from ocriaquant.model.generate import greedy_decode
from ocriaquant.runtime.config import RuntimeConfig
from ocriaquant.runtime.engine import Engine


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="?", default=None)
    ap.add_argument("--pages", type=Path, default=BUNDLED_PAGES)
    ap.add_argument("--max-pages", type=int, default=0)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="torch", choices=("torch", "triton"))
    ap.add_argument("--against", default="transformers", choices=("transformers", "torch"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    pages = select_split(load_pages(args.pages).pages, "heldout")
    if args.max_pages:
        pages = pages[: args.max_pages]
    engine = Engine(args.checkpoint, RuntimeConfig(backend=args.backend, device=args.device, max_slots=args.slots))
    t = time.time()
    ours = {r.rid: r.tokens for r in engine.generate((engine.encode(p) for p in pages), args.max_new_tokens)}
    ours_s = time.time() - t
    tok = engine.processor.tokenizer
    t = time.time()
    if args.against == "torch":
        ref_engine = Engine(args.checkpoint, RuntimeConfig(backend="torch", device=args.device, max_slots=args.slots))
        got = {r.rid: r.text for r in ref_engine.generate((ref_engine.encode(p) for p in pages), args.max_new_tokens)}
        ref = [got[i] for i in range(len(pages))]
    else:
        model, proc = load_model(args.checkpoint, device=args.device)
        ref = greedy_decode(model, proc, pages, batch_size=16, max_new_tokens=args.max_new_tokens)
    ref_s = time.time() - t
    same = [tok.decode(ours[i], skip_special_tokens=True).strip() == ref[i] for i in range(len(pages))]
    res = {"checkpoint": args.checkpoint or "bundled model (BF16)", "pages": len(pages), "identical": sum(same),
           "agreement": sum(same) / len(pages), "differing": [p.name for p, s in zip(pages, same) if not s],
           "runtime_s": round(ours_s, 1), "reference_s": round(ref_s, 1), "slots": args.slots,
           "backend": args.backend, "against": args.against,
           "threads": torch.get_num_threads(), "device": args.device}
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
