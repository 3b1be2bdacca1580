"""Render synthetic document pages (PNG) with exact markdown ground truth (sidecar .md).

    python scripts/make_pages.py --out calib_data --count 128 --seed 0

Same arguments, same files: the generator is seeded and renders with the bundled DejaVu
fonts. `ocriaquant.data.split` assigns each page to calibration or held-out by its name.
"""

import argparse
from pathlib import Path

import json
from dataclasses import asdict

from ocriaquant.data.synth import GRID_STYLE, SynthStyle, write_pages

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--count", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--style", choices=["grid", "proportional"], default="grid",
                    help="grid: 512x512 monospace character grid (what the bundled model reads); "
                         "proportional: 512x640 DejaVu Sans like a memo")
    ap.add_argument("--font-size", type=int, default=15, help="proportional style only")
    ap.add_argument("--max-blocks", type=int, default=None)
    args = ap.parse_args()
    if args.style == "grid":
        style = GRID_STYLE
    else:
        style = SynthStyle(font_size=args.font_size, heading_size=args.font_size + 7,
                           subheading_size=args.font_size + 3)
    if args.max_blocks:
        style = SynthStyle(**{**asdict(style), "max_blocks": args.max_blocks})
    paths = write_pages(args.out, args.count, seed=args.seed, style=style)
    (args.out / "synth.json").write_text(json.dumps({"seed": args.seed, "count": args.count,
                                                     "style": asdict(style)}, indent=1) + "\n")
    print(f"wrote {len(paths)} pages to {args.out}")
