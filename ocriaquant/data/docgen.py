"""Document-style synthetic pages: what ordinary pages have, with the exact markdown as ground truth.

`make_doc_page(seed, style)` draws one page from a seed alone: a title, section headings,
paragraphs set in proportional fonts with their own line breaking (left-aligned or justified,
bold and italic spans), bulleted and numbered lists, ruled or boxed tables, numbers, money,
percentages, dates and punctuation, words from an open vocabulary of ~44,000 English words
and names (SCOWL, `assets/words/`), varied page sizes, margins, fonts and sizes, then paper
tint and slight scan noise (skew, blur, noise, JPEG). The markdown is what was drawn, and only
that: a block that does not fit is left out of both, a paragraph cut at the page's foot keeps
the lines drawn, lines of a paragraph are joined with spaces, every drawn table is a markdown
table, bold and italic spans are `**…**` and `*…*`.

Fonts: the faces matplotlib ships (a dependency already): DejaVu Sans, DejaVu Serif and STIX
General (a Times-like serif), each regular, bold, italic and bold italic, and DejaVu Sans Mono.
The same seed and style give the same pixels wherever the same matplotlib fonts and Pillow are.
"""

from __future__ import annotations

import gzip
import io
import math
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

WORDS_FILE = Path(__file__).resolve().parent.parent / "assets" / "words" / "scowl-en.txt.gz"

# family -> regular, bold, italic, bold italic (files in matplotlib's mpl-data/fonts/ttf)
FAMILIES = {
    "sans": ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf"),
    "serif": ("DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf", "DejaVuSerif-BoldItalic.ttf"),
    "times": ("STIXGeneral.ttf", "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf"),
    "mono": ("DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf",
             "DejaVuSansMono-BoldOblique.ttf"),
}
_FACE = {"": 0, "b": 1, "i": 2, "bi": 3}

# Words that make running text read like text; drawn far more often than the open vocabulary.
_FUNCTION = (
    "the the the of of and and to to a a in in is for on that with as by this are from be at or an it "
    "not which was will has have its their we our all any each more most also than other such these "
    "those per into under over after before between during within about only may must should can "
    "would there been were where when while if but so no both each one two three new"
).split()


@dataclass(frozen=True)
class DocStyle:
    """How document pages vary. Every choice within these ranges is drawn from the page's seed."""

    # (width, height) in px and how often each is drawn; the reader's processor must take the
    # largest without resizing (max_pixels >= its area).
    sizes: tuple[tuple[int, int], ...] = ((512, 640), (640, 832), (768, 1024))
    size_weights: tuple[float, ...] | None = (0.55, 0.3, 0.15)
    font_px: tuple[int, int] = (13, 24)  # body text size range, px
    families: tuple[str, ...] = ("sans", "serif", "times", "mono")
    family_weights: tuple[float, ...] | None = (0.36, 0.27, 0.32, 0.05)
    kinds: tuple[str, ...] = ("heading", "paragraph", "list", "table")
    max_chars: int = 2000  # no block is started once the markdown is this long
    emphasis: bool = True  # bold / italic spans inside paragraphs and list items
    scan: bool = True  # paper tint, ink colour, skew, blur, noise, JPEG; False: black on white, crisp

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - {"heading", "paragraph", "list", "table"}
        if unknown:
            raise ValueError(f"unknown block kinds {sorted(unknown)}")
        bad = set(self.families) - set(FAMILIES)
        if bad:
            raise ValueError(f"unknown font families {sorted(bad)}; known: {sorted(FAMILIES)}")
        if self.size_weights is not None and len(self.size_weights) != len(self.sizes):
            raise ValueError("size_weights must have one weight per size")
        if self.family_weights is not None and len(self.family_weights) != len(self.families):
            raise ValueError("family_weights must have one weight per family")
        if not 6 <= self.font_px[0] <= self.font_px[1]:
            raise ValueError(f"font_px {self.font_px}: want 6 <= low <= high")
        for w, h in self.sizes:
            if w < 128 or h < 128:
                raise ValueError(f"page {w}x{h} too small")


    @classmethod
    def from_dict(cls, d: dict) -> "DocStyle":
        """From `dataclasses.asdict` as written to JSON (lists back to tuples)."""
        def tup(v):
            return tuple(tup(x) for x in v) if isinstance(v, list) else v
        return cls(**{k: tup(v) for k, v in d.items()})


DOC_STYLE = DocStyle()


@dataclass(frozen=True)
class DocPage:
    image: Image.Image
    markdown: str
    seed: int
    drawn: tuple[str, ...] = ()  # every text run drawn, in drawing order (tests: the markdown holds exactly these)


# ---------------------------------------------------------------------------------------------
# Vocabulary and text


@lru_cache(maxsize=1)
def vocabulary() -> dict[str, tuple[str, ...]]:
    """The bundled word list by section: l10 (most common), l20, l35, names."""
    out: dict[str, list[str]] = {}
    cur = None
    with gzip.open(WORDS_FILE, "rt", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("@"):
                cur = line[1:]
                out[cur] = []
            elif cur is not None:
                out[cur].append(line)
    return {k: tuple(v) for k, v in out.items()}


_MONTHS = ("January February March April May June July August September October November December").split()
_UNITS = ("kg", "km", "m", "cm", "mm", "h", "min", "MB", "GB", "kWh", "ml", "t")
_CURRENCY = ("$", "USD ", "EUR ", "GBP ")
_DOMAINS = ("com", "org", "net", "co.uk", "io")


class TextSource:
    """Seeded words, numbers and sentences."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        v = vocabulary()
        self.l10, self.l20, self.l35, self.names = v["l10"], v["l20"], v["l35"], v["names"]

    def content_word(self) -> str:
        r = self.rng.random()
        pool = self.l10 if r < 0.55 else self.l20 if r < 0.82 else self.l35 if r < 0.96 else self.names
        return self.rng.choice(pool)

    def word(self) -> str:
        rng = self.rng
        if rng.random() < 0.33:
            return rng.choice(_FUNCTION)
        w = self.content_word()
        r = rng.random()
        if r < 0.012 and w[-1].isalpha() and "'" not in w:
            w += "'s"
        elif r < 0.03:
            w = f"{w}-{self.content_word().lower()}"
        return w

    def year(self) -> int:
        return self.rng.randint(1975, 2031)

    def integer(self, hi: int = 99999) -> str:
        n = int(math.exp(self.rng.uniform(0, math.log(hi))))
        return f"{n:,}" if n >= 1000 and self.rng.random() < 0.8 else str(n)

    def decimal(self) -> str:
        places = self.rng.choice((1, 2, 2, 3))
        return f"{self.rng.uniform(0, 10 ** self.rng.randint(1, 4)):,.{places}f}"

    def money(self) -> str:
        amount = f"{self.rng.uniform(1, 10 ** self.rng.randint(2, 6)):,.2f}"
        if self.rng.random() < 0.15:
            amount = amount.split(".")[0]
        return self.rng.choice(_CURRENCY) + amount

    def percent(self) -> str:
        return f"{self.rng.uniform(0, 100):.{self.rng.choice((0, 1, 1, 2))}f}%"

    def date(self) -> str:
        rng = self.rng
        y, m, d = self.year(), rng.randint(1, 12), rng.randint(1, 28)
        form = rng.randrange(7)
        if form == 0:
            return f"{y}-{m:02d}-{d:02d}"
        if form == 1:
            return f"{d:02d}/{m:02d}/{y}"
        if form == 2:
            return f"{m}/{d}/{y}"
        if form == 3:
            return f"{_MONTHS[m - 1]} {d}, {y}"
        if form == 4:
            return f"{d} {_MONTHS[m - 1]} {y}"
        if form == 5:
            return f"{_MONTHS[m - 1][:3]} {y}"
        return f"Q{rng.randint(1, 4)} {y}"

    def code(self) -> str:
        rng = self.rng
        prefix = "".join(rng.choice("ABCDEFGHJKLMNPRSTUVWXYZ") for _ in range(rng.randint(2, 3)))
        form = rng.randrange(4)
        if form == 0:
            return f"{prefix}-{rng.randint(100, 99999)}"
        if form == 1:
            return f"No. {rng.randint(1, 9999)}"
        if form == 2:
            return f"{prefix}{rng.randint(10, 999)}"
        return f"{rng.randint(1, 99)}.{rng.randint(1, 20)}"

    def contact(self) -> str:
        rng = self.rng
        form = rng.randrange(4)
        name = self.rng.choice(self.l10 + self.l20).lower()
        if form == 0:
            return f"{name}@{self.rng.choice(self.l10).lower()}.{rng.choice(_DOMAINS)}"
        if form == 1:
            return f"www.{name}.{rng.choice(_DOMAINS)}"
        if form == 2:
            return f"({rng.randint(200, 999)}) {rng.randint(200, 999)}-{rng.randint(1000, 9999)}"
        return f"{rng.randint(0, 23):02d}:{rng.choice((0, 15, 30, 45)):02d}"

    def number_like(self) -> str:
        r = self.rng.random()
        if r < 0.22:
            return self.integer()
        if r < 0.34:
            return self.decimal()
        if r < 0.5:
            return self.money()
        if r < 0.64:
            return self.percent()
        if r < 0.82:
            return self.date()
        if r < 0.88:
            return f"{self.integer(999)} {self.rng.choice(_UNITS)}"
        if r < 0.95:
            return self.code()
        return self.contact()

    def token(self) -> str:
        return self.number_like() if self.rng.random() < 0.07 else self.word()

    def sentence(self, lo: int = 6, hi: int = 18) -> str:
        rng = self.rng
        n = rng.randint(lo, hi)
        words = [self.token() for _ in range(n)]
        # Light punctuation inside: commas, a parenthetical, a quoted phrase, a colon or semicolon.
        for i in range(1, n - 1):
            if rng.random() < 0.07 and words[i][-1].isalnum():
                words[i] += ","
        r = rng.random()
        if r < 0.06 and n > 5:
            i = rng.randrange(1, n - 2)
            j = min(n - 2, i + rng.randint(0, 3))
            words[i] = "(" + words[i]
            words[j] = words[j].rstrip(",") + ")"
        elif r < 0.1 and n > 5:
            i = rng.randrange(1, n - 2)
            j = min(n - 2, i + rng.randint(0, 2))
            words[i] = '"' + words[i]
            words[j] = words[j].rstrip(",") + '"'
        elif r < 0.14 and n > 6:
            i = rng.randrange(2, n - 2)
            if words[i][-1].isalnum():
                words[i] += rng.choice((":", ";"))
        first = words[0]
        words[0] = first[0].upper() + first[1:]
        end = rng.choices((".", "?", "!", ":"), weights=(0.9, 0.05, 0.02, 0.03))[0]
        words[-1] = words[-1].rstrip(",;:") + end
        return " ".join(words)

    def title(self, lo: int = 1, hi: int = 5) -> str:
        rng = self.rng
        words = []
        for k in range(rng.randint(lo, hi)):
            if 0 < k and rng.random() < 0.2:
                words.append(rng.choice(("of", "and", "for", "in", "to", "&", "on")))
            w = self.content_word()
            words.append(w[0].upper() + w[1:] if rng.random() < 0.85 else w)
        if len(words) > 1 and words[-1] in ("of", "and", "for", "in", "to", "&", "on"):
            words.pop()  # a title never ends on a connector; a one-word title may be one ("On")
        words[0] = words[0][0].upper() + words[0][1:]
        text = " ".join(words)
        r = rng.random()
        if r < 0.12:
            text = f"{text} {self.year()}"
        elif r < 0.18:
            text = f"{text}: {self.date()}"
        elif r < 0.22:
            text = text.upper()
        return text

    def phrase(self, lo: int = 1, hi: int = 4, capital: bool = True) -> str:
        words = [self.word() if i else self.content_word() for i in range(self.rng.randint(lo, hi))]
        text = " ".join(words)
        return text[0].upper() + text[1:] if capital else text


# ---------------------------------------------------------------------------------------------
# Spans: text with a face. A block's markdown is its spans joined by spaces, bold as **…**,
# italic as *…*; the drawing lays the same words out.

Span = tuple[str, str]  # (text without leading/trailing spaces, face "" | "b" | "i" | "bi")


def spans_markdown(spans: list[Span]) -> str:
    out = []
    for text, face in spans:
        if face == "b":
            out.append(f"**{text}**")
        elif face == "i":
            out.append(f"*{text}*")
        elif face == "bi":
            out.append(f"***{text}***")
        else:
            out.append(text)
    return " ".join(out)


def _words_of(spans: list[Span]) -> list[tuple[str, str]]:
    return [(w, face) for text, face in spans for w in text.split(" ") if w]


def _md_of_words(words: list[tuple[str, str]]) -> str:
    """Markdown of a run of (word, face): consecutive words of one face become one span."""
    spans: list[Span] = []
    for w, face in words:
        if spans and spans[-1][1] == face:
            spans[-1] = (spans[-1][0] + " " + w, face)
        else:
            spans.append((w, face))
    return spans_markdown(spans)


@lru_cache(maxsize=256)
def _font(family: str, face: str, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(str(font_dir() / FAMILIES[family][_FACE[face]]), size)


@lru_cache(maxsize=1)
def font_dir() -> Path:
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


# ---------------------------------------------------------------------------------------------
# The page


class _Layout:
    """Per-page typographic choices, drawn from the seed."""

    def __init__(self, rng: random.Random, style: DocStyle, width: int, height: int):
        self.width, self.height = width, height
        scale = width / 512
        self.body = rng.randint(*style.font_px)
        self.family = rng.choices(style.families, weights=style.family_weights)[0]
        self.head_family = self.family if rng.random() < 0.55 else rng.choice(
            [f for f in style.families if f != "mono"] or list(style.families))
        self.leading = rng.uniform(1.15, 1.55)
        self.para_gap = rng.uniform(0.25, 1.1)
        self.left = int(rng.uniform(14, 70) * scale)
        self.right = int(rng.uniform(14, 70) * scale)
        self.top = int(rng.uniform(14, 64) * scale)
        self.bottom = int(rng.uniform(14, 56) * scale)
        self.justify = rng.random() < 0.25
        self.indent = int(self.body * rng.uniform(1.0, 2.5)) if rng.random() < 0.15 else 0
        self.h_sizes = {1: int(self.body * rng.uniform(1.45, 2.0)), 2: int(self.body * rng.uniform(1.15, 1.45)),
                        3: int(self.body * rng.uniform(1.0, 1.15))}
        self.h_face = {1: "b", 2: "b", 3: rng.choice(("b", "bi", "i"))}
        self.h1_center = rng.random() < 0.3
        self.h1_rule = rng.random() < 0.2
        self.numbered_headings = rng.random() < 0.25
        self.bullet = rng.choice(("disc", "disc", "dash", "square", "circle"))
        self.table_style = rng.choice(("grid", "grid", "box", "ruled", "lines"))
        self.table_shade = rng.random() < 0.3
        self.table_full = rng.random() < 0.4


class _Canvas:
    """Draws blocks top to bottom into an L image (0 ink, 255 paper); a block is drawn only if it fits."""

    def __init__(self, lay: _Layout):
        self.lay = lay
        self.img = Image.new("L", (lay.width, lay.height), 255)
        self.draw = ImageDraw.Draw(self.img)
        self.y = lay.top
        self.x0 = lay.left
        self.x1 = lay.width - lay.right
        self.bottom = lay.height - lay.bottom
        self.drawn: list[str] = []

    @property
    def text_w(self) -> int:
        return self.x1 - self.x0

    def line_h(self, size: int) -> int:
        return max(size + 2, int(round(size * self.lay.leading)))

    def font(self, face: str, size: int, family: str | None = None) -> ImageFont.FreeTypeFont:
        return _font(family or self.lay.family, face, size)

    # -- line breaking over (word, face) with per-face fonts
    def _break(self, words: list[tuple[str, str]], size: int, width: int, first_indent: int = 0,
               family: str | None = None) -> list[list[tuple[str, str]]] | None:
        lines: list[list[tuple[str, str]]] = []
        cur: list[tuple[str, str]] = []
        cur_w = 0.0
        avail = width - first_indent
        for w, face in words:
            f = self.font(face, size, family)
            ww = f.getlength(w)
            sp = f.getlength(" ")
            if not cur:
                if ww > avail:
                    return None  # a word wider than the line: this block cannot be set here
                cur, cur_w = [(w, face)], ww
            elif cur_w + sp + ww <= avail:
                cur.append((w, face))
                cur_w += sp + ww
            else:
                lines.append(cur)
                avail = width
                if ww > avail:
                    return None
                cur, cur_w = [(w, face)], ww
        if cur:
            lines.append(cur)
        return lines

    def _draw_line(self, line: list[tuple[str, str]], x: float, y_top: int, size: int, width: float,
                   justify: bool, family: str | None = None) -> None:
        fonts = [self.font(face, size, family) for _, face in line]
        widths = [f.getlength(w) for (w, _), f in zip(line, fonts)]
        spaces = [f.getlength(" ") for f in fonts[:-1]]
        gap_extra = 0.0
        if justify and len(line) > 1:
            gap_extra = max(0.0, (width - sum(widths) - sum(spaces)) / (len(line) - 1))
        ascent = self.font("", size, family).getmetrics()[0]
        base = y_top + int(round((self.line_h(size) - size) / 2)) + ascent
        for i, ((w, _), f) in enumerate(zip(line, fonts)):
            self.draw.text((x, base), w, font=f, fill=0, anchor="ls")
            self.drawn.append(w)
            x += widths[i] + (spaces[i] + gap_extra if i < len(line) - 1 else 0)

    def _line_width(self, line, size, family=None) -> float:
        fonts = [self.font(face, size, family) for _, face in line]
        return sum(f.getlength(w) for (w, _), f in zip(line, fonts)) + sum(f.getlength(" ") for f in fonts[:-1])

    def fits(self, h: int) -> bool:
        return self.y + h <= self.bottom

    def gap(self, size: int) -> None:
        self.y += int(size * self.lay.para_gap)

    # -- blocks: each returns its markdown, or None when it did not fit (nothing drawn)
    def heading(self, text: str, level: int) -> str | None:
        size = self.lay.h_sizes[level]
        face = self.lay.h_face[level]
        fam = self.lay.head_family
        words = [(w, face) for w in text.split(" ")]
        lines = self._break(words, size, self.text_w, family=fam)
        if lines is None:
            return None
        space_before = int(size * 0.5) if self.y > self.lay.top else 0
        rule = level == 1 and self.lay.h1_rule
        h = space_before + len(lines) * self.line_h(size) + (6 if rule else 0)
        if not self.fits(h + self.line_h(self.lay.body)):  # keep a heading with a line after it
            return None
        self.y += space_before
        for ln in lines:
            x = self.x0
            if level == 1 and self.lay.h1_center:
                x = self.x0 + (self.text_w - self._line_width(ln, size, fam)) / 2
            self._draw_line(ln, x, self.y, size, self.text_w, False, fam)
            self.y += self.line_h(size)
        if rule:
            self.draw.line((self.x0, self.y + 2, self.x1, self.y + 2), fill=0, width=max(1, size // 14))
            self.y += 6
        self.y += int(size * 0.3)
        return "#" * level + " " + text

    def paragraph(self, spans: list[Span], allow_partial: bool = False, min_lines: int = 2) -> str | None:
        size = self.lay.body
        words = _words_of(spans)
        lines = self._break(words, size, self.text_w, self.lay.indent)
        if lines is None:
            return None
        lh = self.line_h(size)
        room = (self.bottom - self.y) // lh
        if room < len(lines):
            if not allow_partial or room < min_lines:
                return None
            lines = lines[:room]  # the paragraph runs on to the next page: this page has these lines
        for i, ln in enumerate(lines):
            x = self.x0 + (self.lay.indent if i == 0 else 0)
            width = self.text_w - (self.lay.indent if i == 0 else 0)
            self._draw_line(ln, x, self.y, size, width, self.lay.justify and i < len(lines) - 1)
            self.y += lh
        self.gap(size)
        return _md_of_words([w for ln in lines for w in ln])

    def items(self, items: list[list[Span]], numbered: bool) -> str | None:
        size = self.lay.body
        f = self.font("", size)
        marker_w = f.getlength(f"{len(items)}.") if numbered else size * 0.6
        indent = int(size * 0.8)
        text_x = self.x0 + indent + int(marker_w + size * 0.6)
        width = self.x1 - text_x
        wrapped = []
        for it in items:
            lines = self._break(_words_of(it), size, width)
            if lines is None:
                return None
            wrapped.append(lines)
        lh = self.line_h(size)
        item_gap = int(size * self.lay.para_gap * 0.3)
        h = sum(len(w) for w in wrapped) * lh + item_gap * (len(items) - 1)
        if not self.fits(h):
            return None
        md = []
        for n, (it, lines) in enumerate(zip(items, wrapped), 1):
            self._marker(n, numbered, self.x0 + indent, self.y, size, f)
            for ln in lines:
                self._draw_line(ln, text_x, self.y, size, width, False)
                self.y += lh
            self.y += item_gap
            md.append(f"{n}. " if numbered else "- ")
            md[-1] += _md_of_words([w for ln in lines for w in ln])
        self.y -= item_gap
        self.gap(size)
        return "\n".join(md)

    def _marker(self, n: int, numbered: bool, x: int, y_top: int, size: int, f) -> None:
        ascent = f.getmetrics()[0]
        base = y_top + int(round((self.line_h(size) - size) / 2)) + ascent
        if numbered:
            self.draw.text((x, base), f"{n}.", font=f, fill=0, anchor="ls")
            self.drawn.append(f"{n}.")
            return
        cy = base - size * 0.33
        r = max(1.5, size * 0.15)
        cx = x + r + 1
        kind = self.lay.bullet
        if kind == "disc":
            self.draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=0)
        elif kind == "circle":
            self.draw.ellipse((cx - r, cy - r, cx + r, cy + r), outline=0, width=max(1, size // 12))
        elif kind == "square":
            self.draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=0)
        else:
            self.draw.line((cx - r * 1.6, cy, cx + r * 1.6, cy), fill=0, width=max(1, size // 12))

    def table(self, rows: list[list[str]], numeric: list[bool], bold_rows: set[int]) -> str | None:
        size = self.lay.body
        for shrink in (1.0, 0.9, 0.8):  # tables are often set a little smaller than the text
            res = self._table_at(rows, numeric, bold_rows, max(11, int(round(size * shrink))))
            if res is not None or not self._too_wide:
                return res  # drawn, or too tall (a smaller font would not help enough)
        return None

    def _table_at(self, rows, numeric, bold_rows, size) -> str | None:
        self._too_wide = False
        pad = max(3, int(size * 0.45))
        fonts = [[self.font("b" if r == 0 or r in bold_rows else "", size) for _ in row] for r, row in enumerate(rows)]
        ncol = len(rows[0])
        col_w = [max(fonts[r][c].getlength(row[c]) for r, row in enumerate(rows)) + 2 * pad for c in range(ncol)]
        if sum(col_w) > self.text_w:
            self._too_wide = True
            return None
        if self.lay.table_full:
            extra = (self.text_w - sum(col_w)) / ncol
            col_w = [w + extra for w in col_w]
        row_h = self.line_h(size) + pad
        h = row_h * len(rows) + int(size * 0.3)
        if not self.fits(h):
            return None
        x0, y0 = self.x0, self.y
        xs = [x0]
        for w in col_w:
            xs.append(xs[-1] + w)
        st = self.lay.table_style
        if self.lay.table_shade:
            self.draw.rectangle((xs[0], y0, xs[-1], y0 + row_h), fill=228)
        for r, row in enumerate(rows):
            ytop = y0 + r * row_h + pad // 2
            for c, cell in enumerate(row):
                f = fonts[r][c]
                w = f.getlength(cell)
                x = xs[c + 1] - pad - w if numeric[c] and r > 0 else xs[c] + pad
                self._draw_cell(cell, f, x, ytop, size)
        y1 = y0 + len(rows) * row_h
        thin, thick = 1, max(1, size // 10)
        if st == "grid":
            for r in range(len(rows) + 1):
                self.draw.line((xs[0], y0 + r * row_h, xs[-1], y0 + r * row_h), fill=0, width=thin)
            for x in xs:
                self.draw.line((x, y0, x, y1), fill=0, width=thin)
        elif st == "box":
            self.draw.rectangle((xs[0], y0, xs[-1], y1), outline=0, width=thin)
            self.draw.line((xs[0], y0 + row_h, xs[-1], y0 + row_h), fill=0, width=thin)
        elif st == "ruled":
            self.draw.line((xs[0], y0, xs[-1], y0), fill=0, width=thick + 1)
            self.draw.line((xs[0], y0 + row_h, xs[-1], y0 + row_h), fill=0, width=thin)
            self.draw.line((xs[0], y1, xs[-1], y1), fill=0, width=thick + 1)
        else:  # lines: a rule under every row
            for r in range(1, len(rows) + 1):
                self.draw.line((xs[0], y0 + r * row_h, xs[-1], y0 + r * row_h), fill=0, width=thin)
        self.y = y1 + int(size * 0.3)
        self.gap(size)
        md_rows = [[f"**{c}**" if r in bold_rows and r > 0 else c for c in row] for r, row in enumerate(rows)]
        lines = ["| " + " | ".join(md_rows[0]) + " |", "|" + "|".join("---" for _ in rows[0]) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in md_rows[1:]]
        return "\n".join(lines)

    def _draw_cell(self, cell: str, f, x: float, ytop: int, size: int) -> None:
        ascent = self.font("", size).getmetrics()[0]
        base = ytop + int(round((self.line_h(size) - size) / 2)) + ascent
        sp = f.getlength(" ")
        for w in cell.split(" "):
            self.draw.text((x, base), w, font=f, fill=0, anchor="ls")
            self.drawn.append(w)
            x += f.getlength(w) + sp


# ---------------------------------------------------------------------------------------------
# Content


def _emphasized(src: TextSource, text: str, allow: bool) -> list[Span]:
    """Spans of a sentence run: sometimes a bold lead-in label, sometimes an italic phrase."""
    rng = src.rng
    if not allow:
        return [(text, "")]
    r = rng.random()
    if r < 0.12:
        return [(src.title(1, 2).rstrip(":") + ":", "b"), (text, "")]
    if r < 0.22:
        words = text.split(" ")
        if len(words) >= 6:
            i = rng.randrange(1, len(words) - 3)
            j = i + rng.randint(1, 3)
            if all(w[-1].isalnum() for w in words[i:j]):  # no punctuation inside the emphasis
                face = "i" if rng.random() < 0.7 else "b"
                out = []
                if words[:i]:
                    out.append((" ".join(words[:i]), ""))
                out.append((" ".join(words[i:j]), face))
                out.append((" ".join(words[j:]), ""))
                return out
    if r < 0.26:
        return [(text, "i")]
    return [(text, "")]


def _table_rows(src: TextSource, max_cols: int) -> tuple[list[list[str]], list[bool], set[int]]:
    rng = src.rng
    ncol = rng.randint(2, max_cols)
    nrow = rng.randint(2, 8)
    kinds = ["label"] + [rng.choice(("int", "money", "pct", "dec", "date", "word", "int", "money")) for _ in
                         range(ncol - 1)]
    header = [src.title(1, 2) for _ in range(ncol)]
    rows = [header]
    for _ in range(nrow):
        row = []
        for k in kinds:
            if k == "label":
                row.append(src.phrase(1, 3))
            elif k == "int":
                row.append(src.integer())
            elif k == "money":
                row.append(src.money())
            elif k == "pct":
                row.append(src.percent())
            elif k == "dec":
                row.append(src.decimal())
            elif k == "date":
                row.append(src.date())
            else:
                row.append(src.content_word())
        rows.append(row)
    bold: set[int] = set()
    if rng.random() < 0.2 and nrow >= 3:
        rows[-1][0] = rng.choice(("Total", "Total", "Sum", "Average", "Net"))
        bold.add(len(rows) - 1)
    numeric = [k in ("int", "money", "pct", "dec") for k in kinds]
    return rows, numeric, bold


class NothingFits(ValueError):
    """A draw whose first blocks are all too wide or too tall for its page (large type on a small page)."""


def _layout_page(seed: int, style: DocStyle, width: int, height: int, rng: random.Random) -> tuple[_Canvas, str]:
    src = TextSource(rng)
    lay = _Layout(rng, style, width, height)
    cv = _Canvas(lay)
    blocks: list[str] = []
    total = 0
    section = 0

    def add(md: str | None) -> bool:
        nonlocal total
        if md is None:
            return False
        blocks.append(md)
        total += len(md) + 2
        return True

    kinds = style.kinds
    # A page that continues the previous page's paragraph starts mid-sentence, with no title.
    if "paragraph" in kinds and rng.random() < 0.1:
        text = " ".join(src.sentence() for _ in range(rng.randint(1, 3)))
        first = text.split(" ")
        start = rng.randrange(1, max(2, len(first) // 2))
        while start < len(first) - 1 and re.fullmatch(r"\d+[.)]", first[start]):
            start += 1  # "12. rest" would read as a numbered list
        add(cv.paragraph(_emphasized(src, " ".join(first[start:]), style.emphasis)))
    elif "heading" in kinds and rng.random() < 0.9:
        for _ in range(3):  # a title with a word wider than the page at this size: another title
            if add(cv.heading(src.title(2, 6), 1)):
                break
        if rng.random() < 0.35 and "paragraph" in kinds:  # a line of metadata under the title
            label = rng.choice(("Date", "Prepared by", "Ref", "Version", "Period", "Author", "Department",
                                "Client", "Invoice No.", "Status"))
            value = src.date() if label in ("Date", "Period") else src.code() if label in (
                "Ref", "Invoice No.", "Version") else src.phrase(1, 3)
            add(cv.paragraph([(f"{label}:", "b" if rng.random() < 0.5 and style.emphasis else ""), (value, "")]))

    prev = "heading"
    misses = 0  # blocks that did not fit (too tall for the room left, or too wide): three end the page
    for _ in range(60):
        if total >= style.max_chars or misses >= 3:
            break
        weights = {"heading": 0.16, "paragraph": 0.5, "list": 0.17, "table": 0.17}
        choices = [k for k in kinds if not (k == prev and k in ("heading", "list", "table"))] or list(kinds)
        kind = rng.choices(choices, weights=[weights[k] for k in choices])[0]
        md: str | None
        if kind == "heading":
            level = 2 if rng.random() < 0.75 else 3
            text = src.title(1, 5)
            if lay.numbered_headings and level == 2:
                section += 1
                text = f"{section}. {text}"
            md = cv.heading(text, level)
        elif kind == "paragraph":
            text = " ".join(src.sentence() for _ in range(rng.randint(1, 5)))
            md = cv.paragraph(_emphasized(src, text, style.emphasis), allow_partial=rng.random() < 0.6)
        elif kind == "list":
            numbered = rng.random() < 0.35
            n = rng.randint(2, 6)
            items = []
            for _ in range(n):
                text = src.sentence(2, 12) if rng.random() < 0.5 else src.phrase(1, 6)
                if style.emphasis and rng.random() < 0.15:
                    items.append([(src.title(1, 2).rstrip(":") + ":", "b"), (text, "")])
                else:
                    items.append([(text, "")])
            md = cv.items(items, numbered)
        else:
            rows, numeric, bold = _table_rows(src, max_cols=3 if width < 600 else 5)
            if not style.emphasis:
                bold = set()
            md = cv.table(rows, numeric, bold)
        if md is None:
            misses += 1
            continue
        add(md)
        prev = kind
    if not blocks:
        raise NothingFits(f"seed {seed}: nothing fits a {width}x{height} page at body size {lay.body}")
    return cv, "\n\n".join(blocks)


def _scan(img: Image.Image, rng: random.Random, scan: bool) -> Image.Image:
    """Coverage (L, 255 = paper) -> RGB page: tint, ink colour, skew, blur, noise, JPEG."""
    w, h = img.size
    if not scan:
        return img.convert("RGB")
    if rng.random() < 0.25:
        img = img.rotate(rng.uniform(-0.7, 0.7), resample=Image.BICUBIC, fillcolor=255)
    if rng.random() < 0.35:
        img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 0.8)))
    a = np.asarray(img, dtype=np.float32) / 255.0  # 1 paper, 0 ink
    base = rng.uniform(232, 255)
    paper = np.array([base + rng.uniform(-4, 4), base + rng.uniform(-4, 3), base - rng.uniform(0, 14)])
    ink = np.array([rng.uniform(0, 45)] * 3) + np.array([rng.uniform(-8, 8), rng.uniform(-8, 8), rng.uniform(-4, 20)])
    rgb = ink.clip(0, 255) + (paper.clip(0, 255) - ink.clip(0, 255)) * a[..., None]
    if rng.random() < 0.2:  # uneven light across the page
        ramp = np.linspace(1.0, rng.uniform(0.88, 1.0), w if rng.random() < 0.5 else h, dtype=np.float32)
        rgb *= ramp[None, :, None] if ramp.shape[0] == w else ramp[:, None, None]
    if rng.random() < 0.7:
        nrng = np.random.default_rng(rng.getrandbits(32))
        rgb += nrng.normal(0, rng.uniform(1.0, 6.0), size=(h, w, 1)).astype(np.float32)
    out = Image.fromarray(rgb.clip(0, 255).round().astype(np.uint8), "RGB")
    if rng.random() < 0.2:
        buf = io.BytesIO()
        out.save(buf, "JPEG", quality=rng.randint(55, 92))
        buf.seek(0)
        out = Image.open(buf).convert("RGB")
    return out


def make_doc_page(seed: int, style: DocStyle | None = None) -> DocPage:
    """Draw one document page. Same seed and style give the same image and markdown."""
    style = style or DOC_STYLE
    for attempt in range(8):  # where nothing fits (3 seeds in 20,000 at 13-24 px): drawn again, deterministically
        rng = random.Random(f"doc-{seed}" + (f"/{attempt}" if attempt else ""))
        width, height = rng.choices(style.sizes, weights=style.size_weights)[0]
        # Condensed or wide type without other fonts: lay the page out wider or narrower, then scale
        # it to its size (the text's proportions change, the markdown does not).
        stretch = rng.uniform(0.9, 1.1) if style.scan and rng.random() < 0.3 else 1.0
        lay_w = int(round(width / stretch))
        try:
            cv, md = _layout_page(seed, style, lay_w, height, rng)
            break
        except NothingFits:
            if attempt == 7:
                raise
    img = cv.img if lay_w == width else cv.img.resize((width, height), Image.LANCZOS)
    return DocPage(image=_scan(img, rng, style.scan), markdown=md, seed=seed, drawn=tuple(cv.drawn))


def markdown_words(md: str) -> list[str]:
    """The words a markdown page shows, in order: markup (#, list markers, table pipes and
    separator rows, ** and *) removed. What a drawing or a PDF's text layer must hold."""
    out = []
    for line in md.split("\n"):
        s = line.strip()
        if not s:
            continue
        if s.startswith("|"):
            if set(s) <= set("|-: "):
                continue  # the header separator row
            cells = [c.strip() for c in s.strip("|").split("|")]
            s = " ".join(cells)
        elif s.startswith("#"):
            s = s.lstrip("#").strip()
        elif s.startswith("- "):
            s = s[2:]
        else:
            i = 0
            while i < len(s) and s[i].isdigit():
                i += 1
            if i and s[i: i + 2] == ". ":
                s = s[: i + 1] + " " + s[i + 2:]  # keep the number: it is drawn
        s = s.replace("***", "").replace("**", "")
        s = " ".join(w[1:-1] if len(w) > 2 and w.startswith("*") and w.endswith("*") else
                     w[1:] if w.startswith("*") and len(w) > 1 else
                     w[:-1] if w.endswith("*") and len(w) > 1 else w for w in s.split(" "))
        out += [w for w in s.split(" ") if w]
    return out
