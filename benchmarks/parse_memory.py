"""Peak memory of `ocriaquant parse` over a folder of large pages: the resident set of its whole
process tree (the CLI, its page readers, its engine workers), sampled while it runs, against the
pages it has finished. Flat means the memory does not grow with the folder.

    python benchmarks/parse_memory.py --pages 200 --max-new-tokens 4
    python benchmarks/parse_memory.py --pages 200 -- --read-workers 2     # extra flags go to parse
    python benchmarks/parse_memory.py --pages 200 --mode load_pages        # what parse held before #54

It writes N pages of 2016x2016 (4 synthetic layouts with text and a noise band, copied), runs
`ocriaquant parse` on the bundled model (CPU unless told otherwise), and prints RSS every 10 % of
the pages and the peak; `--json FILE` keeps the curve. `--mode load_pages` instead measures
`load_pages` (every page decoded into memory at once: the old parse's first step).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

SIDE = 2016


def make_pages(folder: Path, n: int) -> None:
    import numpy as np
    from PIL import Image

    from ocriaquant.data.synth import SynthStyle, make_page

    folder.mkdir(parents=True, exist_ok=True)
    style = SynthStyle(width=SIDE, height=SIDE, font_size=40, heading_size=56, subheading_size=48, margin=64)
    rng = np.random.default_rng(0)
    layouts = []
    for i in range(min(n, 4)):
        img = np.array(make_page(9_000 + i, style).image.convert("RGB"))
        img[-200:] = rng.integers(0, 256, (200, SIDE, 3), dtype=np.uint8)  # a scanner-noise band
        path = folder / f"layout-{i}.png"
        Image.fromarray(img).save(path)
        layouts.append(path)
    for i in range(n):
        shutil.copy(layouts[i % len(layouts)], folder / f"page-{i:05d}.png")
    for p in layouts:
        p.unlink()


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def watch(cmd: list[str], out: Path | None, n: int, every: float = 0.2) -> dict:
    t0 = time.time()
    proc = psutil.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples = []
    while proc.poll() is None:
        done = sum(1 for _ in out.glob("*.md")) if out is not None else None
        samples.append({"t": round(time.time() - t0, 1), "pages_done": done, "rss_mb": round(tree_rss(proc) / 2**20)})
        time.sleep(every)
    err = proc.stderr.read()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    curve = []
    if out is not None:
        for k in range(1, 11):  # the largest RSS seen while each tenth of the pages was being parsed
            lo, hi = (k - 1) * n // 10, k * n // 10
            seen = [s["rss_mb"] for s in samples if lo <= s["pages_done"] < hi or (k == 10 and s["pages_done"] >= hi)]
            curve.append({"pages_done": f"{lo}-{hi}", "rss_mb": max(seen) if seen else None})
    return {"seconds": round(time.time() - t0, 1), "peak_rss_mb": max(s["rss_mb"] for s in samples),
            "curve": curve, "samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--mode", choices=["parse", "load_pages"], default="parse")
    ap.add_argument("--workdir", type=Path, default=None, help="where the pages go (default: a temporary folder)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("extra", nargs="*", help="flags passed on to `ocriaquant parse` (after --)")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="parse-memory-"))
    pages, out = work / "pages", work / "parsed"
    if not pages.is_dir() or len(list(pages.glob("*.png"))) != args.pages:
        shutil.rmtree(pages, ignore_errors=True)
        make_pages(pages, args.pages)
    shutil.rmtree(out, ignore_errors=True)
    if args.mode == "parse":
        from ocriaquant.model.load import resolve_model_dir

        cmd = [sys.executable, "-m", "ocriaquant", "parse", str(resolve_model_dir(None)), str(pages), "--out", str(out),
               "--max-new-tokens", str(args.max_new_tokens), *args.extra]
        rep = watch(cmd, out, args.pages)
    else:
        code = (f"from ocriaquant.data import load_pages; r = load_pages({str(pages)!r}); "
                f"print(len(r.pages))")
        rep = watch([sys.executable, "-c", code], None, args.pages)
    rep.update({"mode": args.mode, "pages": args.pages, "page_px": [SIDE, SIDE], "extra": args.extra})
    print(f"{args.mode}: {args.pages} pages of {SIDE}x{SIDE} in {rep['seconds']} s, peak RSS {rep['peak_rss_mb']} MB "
          "(process tree)")
    for c in rep["curve"]:
        print(f"  while pages {c['pages_done']:>9} were done: {c['rss_mb']} MB")
    if args.json:
        args.json.write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
