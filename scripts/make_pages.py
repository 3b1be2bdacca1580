"""Render synthetic pages (PNG) with exact markdown ground truth (sidecar .md).

    python scripts/make_pages.py --out pages --count 64 --seed 1                  # document pages
    python scripts/make_pages.py --out calib_data --count 96 --sizes 512x640 --jpeg 85  # the bundled pages
    python scripts/make_pages.py --out calib_data --count 128 --seed 0 --style grid  # the bundled grid pages
    python scripts/make_pages.py --out judge --count 32 --seed 7 --renderer reportlab  # the second renderer

Same arguments, same files: every generator is seeded. `--style doc` (ocriaquant.data.docgen):
proportional fonts (matplotlib's DejaVu Sans / Serif and STIX, bold and italic), headings,
lists, ruled and boxed tables, numbers and dates, an open vocabulary, paper tint and scan noise.
`--style grid`: the monospace character grid the bundled ocria-nano reads. `--renderer
reportlab` (needs the `judge` extra): pages typeset by reportlab in PDF's standard fonts and
rasterized by pdfium (ocriaquant.data.typeset), a held-out test set for a reader trained on our
own generator; each page's markdown is checked against the PDF's text layer.
`ocriaquant.data.split` assigns each page to calibration or held-out by its name.
"""

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from ocriaquant.data.synth import DOC_STYLE, GRID_STYLE, SynthStyle, write_pages


def _size(text: str) -> tuple[int, int]:
    w, h = text.lower().split("x")
    return int(w), int(h)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--count", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--renderer", choices=["ours", "reportlab"], default="ours",
                    help="ours: ocriaquant's generators (--style); reportlab: the independent second renderer")
    ap.add_argument("--style", choices=["doc", "grid", "proportional"], default="doc",
                    help="doc: document pages (sizes, fonts and noise vary per page); grid: 512x512 monospace "
                         "character grid (what the bundled model reads); proportional: 512x640 DejaVu Sans memo")
    ap.add_argument("--sizes", default=None,
                    help="doc / reportlab: page sizes WxH, comma-separated (doc default 512x640,640x832,768x1024 "
                         "weighted 0.55:0.3:0.15; reportlab default 512x640); each page draws one")
    ap.add_argument("--font-px", default=None, help="doc: body font size range LO-HI px (default 13-24)")
    ap.add_argument("--max-chars", type=int, default=None, help="doc: start no block past this many characters")
    ap.add_argument("--clean", action="store_true", help="doc: black on white, no skew, blur or noise")
    ap.add_argument("--jpeg", type=int, default=None, metavar="QUALITY",
                    help="ours: write JPEG at this quality (e.g. 85) instead of PNG")
    ap.add_argument("--font-size", type=int, default=15, help="proportional style only")
    ap.add_argument("--max-blocks", type=int, default=None, help="grid / proportional styles")
    args = ap.parse_args()
    sizes = tuple(_size(s) for s in args.sizes.split(",")) if args.sizes else None

    if args.renderer == "reportlab":
        from ocriaquant.data.typeset import write_typeset_pages

        size = sizes[0] if sizes else (512, 640)
        paths = []
        for k, sz in enumerate(sizes or [size]):  # pages split evenly over the sizes given
            n = args.count // len(sizes or [size]) + (k < args.count % len(sizes or [size]))
            paths += write_typeset_pages(args.out, n, seed=args.seed * 101 + k, size=sz,
                                         prefix=f"rl{sz[0]}x{sz[1]}" if sizes and len(sizes) > 1 else "rl")
        meta = {"renderer": "reportlab", "seed": args.seed, "count": args.count, "sizes": sizes or [size]}
    else:
        if args.style == "grid":
            style = GRID_STYLE
        elif args.style == "proportional":
            style = SynthStyle(font_size=args.font_size, heading_size=args.font_size + 7,
                               subheading_size=args.font_size + 3)
        else:
            style = DOC_STYLE
            if sizes:
                style = replace(style, sizes=sizes, size_weights=None)
            if args.font_px:
                lo, hi = (int(v) for v in args.font_px.split("-"))
                style = replace(style, font_px=(lo, hi))
            if args.max_chars:
                style = replace(style, max_chars=args.max_chars)
            if args.clean:
                style = replace(style, scan=False)
        if args.max_blocks and args.style != "doc":
            style = replace(style, max_blocks=args.max_blocks)
        paths = write_pages(args.out, args.count, seed=args.seed, style=style, jpeg_quality=args.jpeg)
        meta = {"renderer": "ours", "style_name": args.style, "seed": args.seed, "count": args.count,
                "jpeg_quality": args.jpeg, "style": asdict(style)}
    (args.out / "synth.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {len(paths)} pages to {args.out}")
