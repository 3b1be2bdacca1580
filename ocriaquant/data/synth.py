"""Synthetic document pages with exact markdown ground truth.

Each page is drawn from a seed alone: headings, paragraphs, bulleted lists and small
tables, rendered with a bundled DejaVu font so that the same seed gives the same pixels on
every machine. The markdown returned with the image is exactly what was drawn: a block
that does not fit on the page is left out of both.

Three styles: `GRID_STYLE` (monospace on a fixed character grid, a ~300-word vocabulary: what
the bundled ocria-nano reads), `SynthStyle()` (one proportional sans face, the same
vocabulary), and document pages (`docgen.DocStyle`, `DOC_STYLE`: proportional serif / sans /
Times-like faces in bold and italic, sizes 13-24 px on 512-768 px pages, numbered and bulleted
lists, ruled and boxed tables, an open vocabulary, paper tint and scan noise). `make_page` and
`write_pages` take any of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from .docgen import DOC_STYLE, DocStyle, make_doc_page  # noqa: F401  (DOC_STYLE: re-exported beside GRID_STYLE)

FONT_DIR = Path(__file__).resolve().parent.parent / "assets" / "fonts"

# A small, fixed vocabulary keeps the ground truth learnable by a tiny model while still
# covering the characters a document page typically has.
_WORDS = (
    "the of and to in is for on that with as by this are from be at or an it not which "
    "data model page report table value total result method system time rate cost sample "
    "test group layer level price order number line text figure section summary account "
    "annual quarter market sales income growth revenue profit budget review policy project "
    "design energy water health school city north south east west first second final new "
    "small large high low early late open closed public private local global average mean "
    "index share unit part note item record field input output source target service client"
).split()
_NAMES = (
    "Overview Results Methods Summary Background Findings Appendix Notes Scope Budget "
    "Timeline Outlook Risks Metrics Inventory Schedule Contacts Pricing Revenue Operations"
).split()


@dataclass(frozen=True)
class SynthStyle:
    """How pages look. The defaults give ~512x640 pages like a phone scan of a memo."""

    width: int = 512
    height: int = 640
    font_size: int = 15
    heading_size: int = 22
    subheading_size: int = 18
    margin: int = 28
    monospace: bool = False
    max_blocks: int = 8
    kinds: tuple[str, ...] = ("paragraph", "list", "table", "subheading")
    # Grid mode: every character sits in its own cell_w x cell_h cell (monospace, one glyph
    # per cell). With 16x32 cells each 32x32 merged vision token sees exactly two characters
    # of one line: the easiest layout for a tiny model to learn to read.
    grid: bool = False
    cell_w: int = 16
    cell_h: int = 32

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - {"paragraph", "list", "table", "subheading"}
        if unknown:
            raise ValueError(f"unknown block kinds {sorted(unknown)}")
        if self.width < 4 * self.margin or self.height < 4 * self.margin:
            raise ValueError(f"page {self.width}x{self.height} too small for margin {self.margin}")


@dataclass(frozen=True)
class SynthPage:
    image: Image.Image
    markdown: str
    seed: int


@lru_cache(maxsize=32)
def _font(size: int, bold: bool, mono: bool) -> ImageFont.FreeTypeFont:
    name = "DejaVuSansMono" if mono else "DejaVuSans"
    return ImageFont.truetype(str(FONT_DIR / f"{name}{'-Bold' if bold else ''}.ttf"), size)


def _sentence(rng: random.Random, lo: int = 5, hi: int = 11) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(2, 2030)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + "."


def _title(rng: random.Random) -> str:
    return f"{rng.choice(_NAMES)} {rng.randint(1, 99)}" if rng.random() < 0.5 else rng.choice(_NAMES)


def _wrap(text: str, font: ImageFont.FreeTypeFont, width: int) -> list[str]:
    lines: list[str] = []
    cur = ""
    for word in text.split(" "):
        trial = f"{cur} {word}" if cur else word
        if font.getlength(trial) <= width or not cur:
            cur = trial
        else:
            lines.append(cur)
            cur = word
    if cur:
        lines.append(cur)
    return lines


class _Canvas:
    """Draws blocks top to bottom; a block is committed only if it fits."""

    def __init__(self, style: SynthStyle):
        self.s = style
        self.img = Image.new("L", (style.width, style.height), 255)
        self.draw = ImageDraw.Draw(self.img)
        self.y = style.margin
        self.text_w = style.width - 2 * style.margin

    def font(self, size: int, bold: bool = False) -> ImageFont.FreeTypeFont:
        return _font(size, bold, self.s.monospace)

    def fits(self, height: int) -> bool:
        return self.y + height <= self.s.height - self.s.margin

    def line_h(self, size: int) -> int:
        return int(size * 1.35)

    def heading(self, text: str, size: int) -> bool:
        return self.paragraph(text, size, bold=True)

    def paragraph(self, text: str, size: int | None = None, bold: bool = False) -> bool:
        size = size or self.s.font_size
        f = self.font(size, bold=bold)
        lines = _wrap(text, f, self.text_w)
        h = len(lines) * self.line_h(size) + size // 2
        if not self.fits(h):
            return False
        for ln in lines:
            self.draw.text((self.s.margin, self.y), ln, font=f, fill=0)
            self.y += self.line_h(size)
        self.y += size // 2
        return True

    def bullets(self, items: list[str]) -> bool:
        size = self.s.font_size
        f = self.font(size)
        indent = int(size * 1.4)
        wrapped = [_wrap(it, f, self.text_w - indent) for it in items]
        h = sum(len(w) for w in wrapped) * self.line_h(size) + size // 2
        if not self.fits(h):
            return False
        for lines in wrapped:
            r = max(2, size // 6)
            cy = self.y + size // 2 + 1
            cx = self.s.margin + size // 2
            self.draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=0)
            for ln in lines:
                self.draw.text((self.s.margin + indent, self.y), ln, font=f, fill=0)
                self.y += self.line_h(size)
        self.y += size // 2
        return True

    def table(self, rows: list[list[str]]) -> bool:
        size = self.s.font_size
        f, fb = self.font(size), self.font(size, bold=True)
        pad = size // 2
        ncol = len(rows[0])
        col_w = [
            max(int((fb if r == 0 else f).getlength(row[c])) for r, row in enumerate(rows)) + 2 * pad
            for c in range(ncol)
        ]
        if sum(col_w) > self.text_w:
            return False
        row_h = self.line_h(size) + pad
        h = row_h * len(rows) + size // 2
        if not self.fits(h):
            return False
        x0, y0 = self.s.margin, self.y
        for r, row in enumerate(rows):
            x = x0
            for c, cell in enumerate(row):
                self.draw.text((x + pad, self.y + pad // 2), cell, font=fb if r == 0 else f, fill=0)
                x += col_w[c]
            self.y += row_h
        # Grid lines: outer box, one line under every row, one between columns.
        x1 = x0 + sum(col_w)
        for r in range(len(rows) + 1):
            self.draw.line((x0, y0 + r * row_h, x1, y0 + r * row_h), fill=0, width=1)
        x = x0
        for c in range(ncol + 1):
            self.draw.line((x, y0, x, y0 + len(rows) * row_h), fill=0, width=1)
            x += col_w[c] if c < ncol else 0
        self.y += size // 2
        return True


class _GridCanvas:
    """Monospace pages on a character grid: blocks separated by a blank row, H1 bold and
    underlined, H2 bold, bullets as a dot in the first cell, tables boxed with rules."""

    def __init__(self, style: SynthStyle):
        self.s = style
        self.img = Image.new("L", (style.width, style.height), 255)
        self.draw = ImageDraw.Draw(self.img)
        self.cols = (style.width - 2 * style.margin) // style.cell_w
        self.rows = (style.height - 2 * style.margin) // style.cell_h
        self.row = 0
        size = int(style.cell_h * 0.7)
        self.regular, self.bold = _font(size, False, True), _font(size, True, True)

    def _fits(self, n_rows: int) -> bool:
        return self.row + n_rows <= self.rows

    def _xy(self, col: int, row: int) -> tuple[int, int]:
        return self.s.margin + col * self.s.cell_w, self.s.margin + row * self.s.cell_h

    def _put(self, text: str, col: int, font) -> None:
        for i, ch in enumerate(text):
            x, y = self._xy(col + i, self.row)
            # Centre the glyph in its cell.
            self.draw.text((x + self.s.cell_w / 2, y + self.s.cell_h / 2), ch, font=font, fill=0, anchor="mm")

    def _wrap(self, text: str, width: int) -> list[str] | None:
        lines, cur = [], ""
        for word in text.split(" "):
            if len(word) > width:
                return None
            trial = f"{cur} {word}" if cur else word
            if len(trial) <= width:
                cur = trial
            else:
                lines.append(cur)
                cur = word
        return lines + [cur] if cur else lines

    def _gap(self) -> None:
        self.row += 1  # blank row between blocks

    def heading(self, text: str, size: int) -> bool:
        level1 = size == self.s.heading_size
        lines = self._wrap(text, self.cols)
        if lines is None or not self._fits(len(lines) + 1):
            return False
        for ln in lines:
            self._put(ln, 0, self.bold)
            if level1:
                x, y = self._xy(0, self.row)
                yb = y + self.s.cell_h - 3
                self.draw.line((x, yb, x + len(ln) * self.s.cell_w, yb), fill=0, width=2)
            self.row += 1
        self._gap()
        return True

    def paragraph(self, text: str) -> bool:
        lines = self._wrap(text, self.cols)
        if lines is None or not self._fits(len(lines) + 1):
            return False
        for ln in lines:
            self._put(ln, 0, self.regular)
            self.row += 1
        self._gap()
        return True

    def bullets(self, items: list[str]) -> bool:
        wrapped = [self._wrap(it, self.cols - 2) for it in items]
        if any(w is None for w in wrapped) or not self._fits(sum(len(w) for w in wrapped) + 1):
            return False
        r = max(2, self.s.cell_w // 5)
        for lines in wrapped:
            x, y = self._xy(0, self.row)
            cx, cy = x + self.s.cell_w // 2, y + self.s.cell_h // 2
            self.draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=0)
            for ln in lines:
                self._put(ln, 2, self.regular)
                self.row += 1
        self._gap()
        return True

    def table(self, rows: list[list[str]]) -> bool:
        ncol = len(rows[0])
        widths = [max(len(r[c]) for r in rows) for c in range(ncol)]
        # One separator cell before, between and after columns.
        total = sum(widths) + ncol + 1
        if total > self.cols or not self._fits(len(rows) + 1):
            return False
        seps = [0]
        for w in widths:
            seps.append(seps[-1] + w + 1)
        top = self.row
        for r, row in enumerate(rows):
            for c, cell in enumerate(row):
                self._put(cell, seps[c] + 1, self.bold if r == 0 else self.regular)
            self.row += 1
        cw, ch = self.s.cell_w, self.s.cell_h
        x0, y0 = self._xy(0, top)
        x1, y1 = x0 + seps[-1] * cw + cw // 2, y0 + len(rows) * ch
        for sep in seps:  # vertical rules through the middle of separator cells
            xs = x0 + sep * cw + cw // 2
            self.draw.line((xs, y0, xs, y1), fill=0, width=1)
        for yr in (y0, y0 + ch, y1):  # box top, rule under the header, box bottom
            self.draw.line((x0 + cw // 2, yr, x1, yr), fill=0, width=1)
        self._gap()
        return True


def _table_rows(rng: random.Random) -> list[list[str]]:
    ncol, nrow = rng.randint(2, 3), rng.randint(2, 4)
    header = [w.capitalize() for w in rng.sample(_WORDS[20:], ncol)]
    rows = [header]
    for _ in range(nrow):
        row = [rng.choice(_WORDS[20:])]
        row += [str(rng.randint(0, 999)) if rng.random() < 0.7 else f"{rng.uniform(0, 99):.1f}"
                for _ in range(ncol - 1)]
        rows.append(row)
    return rows


def _table_md(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "| " + " | ".join("---" for _ in rows[0]) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def make_page(seed: int, style: SynthStyle | DocStyle | None = None) -> SynthPage:
    """Draw one page. Same seed and style give the same image and markdown."""
    if isinstance(style, DocStyle):
        doc = make_doc_page(seed, style)
        return SynthPage(image=doc.image, markdown=doc.markdown, seed=seed)
    style = style or SynthStyle()
    rng = random.Random(seed)
    cv = _GridCanvas(style) if style.grid else _Canvas(style)
    blocks: list[str] = []

    title = _title(rng)
    if not cv.heading(title, style.heading_size):  # a grid page too narrow for the title
        raise ValueError(f"page {style.width}x{style.height} cannot hold a heading at size {style.heading_size}")
    blocks.append(f"# {title}")

    prev = "subheading"  # the title is a heading: never two in a row
    for _ in range(style.max_blocks):
        # Two lists or two tables in a row would read as one block; redraw instead.
        choices = [k for k in style.kinds if k != prev] or list(style.kinds)
        kind = prev = rng.choice(choices)
        if kind == "subheading":
            text = _title(rng)
            ok, md = cv.heading(text, style.subheading_size), f"## {text}"
        elif kind == "paragraph":
            text = " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
            ok, md = cv.paragraph(text), text
        elif kind == "list":
            items = [_sentence(rng, 2, 6).rstrip(".") for _ in range(rng.randint(2, 4))]
            ok, md = cv.bullets(items), "\n".join(f"- {it}" for it in items)
        else:
            rows = _table_rows(rng)
            ok, md = cv.table(rows), _table_md(rows)
        if not ok:
            break
        blocks.append(md)

    return SynthPage(image=cv.img.convert("RGB"), markdown="\n\n".join(blocks), seed=seed)


def write_pages(out_dir: Path, count: int, seed: int = 0, style: SynthStyle | DocStyle | None = None,
                prefix: str = "page", jpeg_quality: int | None = None) -> list[Path]:
    """Write `count` pages as PNG (or JPEG at `jpeg_quality`) + sidecar .md; returns the image paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        page = make_page(seed * 1_000_003 + i, style)
        if jpeg_quality is None:
            img_path = out_dir / f"{prefix}-{i:04d}.png"
            page.image.save(img_path, optimize=True)
        else:  # a scanned page's own format: ~1/8 of the PNG's bytes for a noisy tinted page
            img_path = out_dir / f"{prefix}-{i:04d}.jpg"
            page.image.convert("RGB").save(img_path, quality=jpeg_quality, optimize=True)
        (out_dir / f"{prefix}-{i:04d}.md").write_text(page.markdown + "\n", encoding="utf-8")
        paths.append(img_path)
    return paths


def style_with(**overrides) -> SynthStyle:
    return replace(SynthStyle(), **overrides)


# The bundled pages (calib_data/) and the reference model's training pages: a 512x512 grid
# page of 30x15 character cells, headings, paragraphs, lists and tables.
GRID_STYLE = SynthStyle(width=512, height=512, margin=16, grid=True, cell_w=16, cell_h=32, max_blocks=6)
