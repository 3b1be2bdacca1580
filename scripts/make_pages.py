"""Render synthetic document pages (PNG) with exact markdown ground truth (sidecar .md).

    python scripts/make_pages.py --out calib_data --count 128 --seed 0

Same arguments, same files: the generator is seeded and renders with the bundled DejaVu
fonts. `ocriaquant.data.split` assigns each page to calibration or held-out by its name.
"""

import argparse
from pathlib import Path

from ocriaquant.data.synth import SynthStyle, write_pages

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--count", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--height", type=int, default=640)
    ap.add_argument("--font-size", type=int, default=15)
    ap.add_argument("--max-blocks", type=int, default=8)
    ap.add_argument("--monospace", action="store_true")
    args = ap.parse_args()
    style = SynthStyle(width=args.width, height=args.height, font_size=args.font_size,
                       heading_size=args.font_size + 7, subheading_size=args.font_size + 3,
                       max_blocks=args.max_blocks, monospace=args.monospace)
    paths = write_pages(args.out, args.count, seed=args.seed, style=style)
    print(f"wrote {len(paths)} pages to {args.out}")
