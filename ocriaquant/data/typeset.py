"""A second, independent renderer for judging a reader: pages typeset by reportlab, rasterized by pypdfium2.

Our own generator (`docgen`) lays text out itself with Pillow and matplotlib's fonts. A reader
trained on it could learn that one engine's habits (its line breaking, its spacing, its glyphs)
rather than reading. These pages come from elsewhere, as real documents arrive: reportlab's
platypus sets paragraphs (its own line breaking, justification and inter-word spacing),
lists and tables (its own grid and cell padding) in PDF's standard fonts (Times-Roman,
Helvetica-Bold, Courier …, not embedded), and pdfium renders them with its own substitutes of
those fonts. Their content comes from its own templates (memos, reports, invoices, minutes):
everyday words from the same English word list, set in its own way.

They are a held-out test set only: nothing that trains the reader imports this module.

The markdown is what the page shows: a page is built from blocks and the last block is dropped
until everything fits on one page (no paragraph runs over), and every page is checked against
the PDF's own text layer (the words pdfium reads from it, in order, equal the markdown's words).
Needs the optional `reportlab` package (`pip install -e ".[judge]"`).
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from PIL import Image

from .docgen import TextSource, markdown_words

# Standard-14 families: (regular, bold, italic, bold italic)
PDF_FAMILIES = {
    "Times": ("Times-Roman", "Times-Bold", "Times-Italic", "Times-BoldItalic"),
    "Helvetica": ("Helvetica", "Helvetica-Bold", "Helvetica-Oblique", "Helvetica-BoldOblique"),
    "Courier": ("Courier", "Courier-Bold", "Courier-Oblique", "Courier-BoldOblique"),
}
_BULLET_GLYPHS = ("\u2022", "\u2013", "-")


@dataclass(frozen=True)
class TypesetPage:
    image: Image.Image
    markdown: str
    seed: int
    pdf: bytes
    text_layer_words: tuple[str, ...]  # the words pdfium reads from the PDF, bullets left out


class _Content:
    """Blocks of one business document: (kind, payload, markdown)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.src = TextSource(rng)

    def everyday(self) -> str:
        w = self.rng.choice(self.src.l10 if self.rng.random() < 0.8 else self.src.l20)
        return w

    def sentence(self) -> list[tuple[str, str]]:
        """Runs of (text, face) of one sentence: mostly everyday words, some numbers and dates."""
        rng, src = self.rng, self.src
        words = []
        for i in range(rng.randint(5, 16)):
            r = rng.random()
            if r < 0.06:
                words.append(src.number_like())
            elif r < 0.4:
                words.append(rng.choice(("the", "of", "and", "to", "a", "in", "for", "is", "on", "with", "by",
                                         "we", "our", "will", "be", "this", "that", "are", "all", "from")))
            else:
                words.append(self.everyday())
            if 0 < i and rng.random() < 0.06 and words[-1][-1].isalnum():
                words[-1] += ","
        words[0] = words[0][0].upper() + words[0][1:]
        words[-1] = words[-1].rstrip(",") + rng.choice(".......?")
        runs = [(" ".join(words), "")]
        if rng.random() < 0.12 and len(words) > 5:  # one italic or bold phrase
            i = rng.randrange(1, len(words) - 3)
            j = i + rng.randint(1, 2)
            if all(w[-1].isalnum() for w in words[i:j]):
                face = rng.choice(("i", "i", "b"))
                runs = [(" ".join(words[:i]), ""), (" ".join(words[i:j]), face), (" ".join(words[j:]), "")]
        return runs

    def heading(self) -> str:
        rng = self.rng
        words = [self.everyday().capitalize() for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.2:
            words.append(str(self.src.year()))
        return " ".join(words)

    def table(self, ncol: int) -> tuple[list[list[str]], list[bool]]:
        rng, src = self.rng, self.src
        kinds = ["label"] + [rng.choice(("int", "money", "pct", "date", "money")) for _ in range(ncol - 1)]
        rows = [[self.heading() if c == 0 else rng.choice(("Amount", "Total", "Qty", "Date", "Rate", "Budget",
                                                             "Actual", "Change", "Price", "Units", "Due"))
                 for c in range(ncol)]]
        for _ in range(rng.randint(2, 6)):
            row = []
            for k in kinds:
                row.append({"label": lambda: " ".join(self.everyday().capitalize() if i == 0 else self.everyday()
                                                      for i in range(rng.randint(1, 3))),
                            "int": src.integer, "money": src.money, "pct": src.percent, "date": src.date}[k]())
            rows.append(row)
        return rows, [k in ("int", "money", "pct") for k in kinds]


def _runs_md(runs: list[tuple[str, str]]) -> str:
    parts = []
    for text, face in runs:
        if not text:
            continue
        parts.append(f"**{text}**" if face == "b" else f"*{text}*" if face == "i" else text)
    return " ".join(parts)


def _runs_xml(runs: list[tuple[str, str]]) -> str:
    parts = []
    for text, face in runs:
        if not text:
            continue
        t = escape(text)
        parts.append(f"<b>{t}</b>" if face == "b" else f"<i>{t}</i>" if face == "i" else t)
    return " ".join(parts)


def _blocks(rng: random.Random, width: int) -> list[tuple[str, object, str]]:
    """The document, longer than a page: kind, payload for reportlab, markdown."""
    c = _Content(rng)
    genre = rng.choice(("memo", "report", "invoice", "minutes", "notice"))
    blocks: list[tuple[str, object, str]] = []
    title = {"memo": "Memo", "report": "Report", "invoice": "Invoice", "minutes": "Minutes", "notice": "Notice"}[genre]
    title = f"{title}: {c.heading()}" if rng.random() < 0.6 else c.heading()
    blocks.append(("h1", title, f"# {title}"))
    if genre in ("memo", "invoice", "minutes") or rng.random() < 0.3:
        for label in rng.sample(("To", "From", "Date", "Subject", "Reference", "Account"), rng.randint(1, 3)):
            value = c.src.date() if label == "Date" else c.src.code() if label in ("Reference", "Account") \
                else c.heading()
            runs = [(f"{label}:", "b"), (value, "")]
            blocks.append(("p", runs, _runs_md(runs)))
    for _ in range(30):
        r = rng.random()
        if r < 0.45:
            runs = []
            for _ in range(rng.randint(1, 4)):
                runs += c.sentence()
            runs = [(t, f) for t, f in runs if t]
            blocks.append(("p", runs, _runs_md(runs)))
        elif r < 0.62:
            h = c.heading()
            blocks.append(("h2", h, f"## {h}"))
        elif r < 0.8:
            numbered = rng.random() < 0.4
            items = []
            for _ in range(rng.randint(2, 5)):
                runs = c.sentence() if rng.random() < 0.5 else [(c.heading(), "")]
                items.append(runs)
            md = "\n".join(f"{i}. {_runs_md(it)}" if numbered else f"- {_runs_md(it)}" for i, it in
                           enumerate(items, 1))
            blocks.append(("ol" if numbered else "ul", items, md))
        else:
            rows, numeric = c.table(rng.randint(2, 4 if width >= 600 else 3))
            md = "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "|".join("---" for _ in rows[0]) + "|"]
                           + ["| " + " | ".join(r) + " |" for r in rows[1:]])
            blocks.append(("table", (rows, numeric), md))
    return blocks


def _build_pdf(blocks, width: int, height: int, rng_state: dict) -> tuple[bytes, int]:
    """Typeset blocks on pages of width x height points; returns the PDF and its page count."""
    from reportlab.lib import colors
    from reportlab.lib.enums import TA_CENTER, TA_JUSTIFY, TA_LEFT
    from reportlab.lib.styles import ParagraphStyle
    from reportlab.platypus import ListFlowable, ListItem, Paragraph, SimpleDocTemplate, Spacer, Table, TableStyle

    s = rng_state
    body_font = PDF_FAMILIES[s["body"]]
    head_font = PDF_FAMILIES[s["head"]]
    size = s["size"]
    body = ParagraphStyle("body", fontName=body_font[0], fontSize=size, leading=size * s["leading"],
                          alignment=TA_JUSTIFY if s["justify"] else TA_LEFT, spaceAfter=size * 0.6)
    h1 = ParagraphStyle("h1", fontName=head_font[1], fontSize=size * 1.6, leading=size * 1.9,
                        alignment=TA_CENTER if s["center"] else TA_LEFT, spaceAfter=size * 0.5)
    h2 = ParagraphStyle("h2", fontName=head_font[1], fontSize=size * 1.25, leading=size * 1.5,
                        spaceBefore=size * 0.4, spaceAfter=size * 0.3)
    flow = []
    for kind, payload, _ in blocks:
        if kind == "h1":
            flow.append(Paragraph(escape(payload), h1))
        elif kind == "h2":
            flow.append(Paragraph(escape(payload), h2))
        elif kind == "p":
            flow.append(Paragraph(_runs_xml(payload), body))
        elif kind in ("ul", "ol"):
            items = [ListItem(Paragraph(_runs_xml(it), body)) for it in payload]
            if kind == "ol":
                flow.append(ListFlowable(items, bulletType="1", bulletFormat="%s.", bulletFontName=body_font[0],
                                         bulletFontSize=size, leftIndent=size * 1.8))
            else:
                flow.append(ListFlowable(items, bulletType="bullet", start=s["bullet"], bulletFontName=body_font[0],
                                         bulletFontSize=size, leftIndent=size * 1.5))
            flow.append(Spacer(1, size * 0.3))
        else:
            rows, numeric = payload
            cmds = [("FONTNAME", (0, 0), (-1, 0), body_font[1]), ("FONTNAME", (0, 1), (-1, -1), body_font[0]),
                    ("FONTSIZE", (0, 0), (-1, -1), size * 0.95), ("VALIGN", (0, 0), (-1, -1), "MIDDLE")]
            for ci, num in enumerate(numeric):
                if num:
                    cmds.append(("ALIGN", (ci, 1), (ci, -1), "RIGHT"))
            if s["table"] == "grid":
                cmds.append(("GRID", (0, 0), (-1, -1), 0.7, colors.black))
            elif s["table"] == "box":
                cmds += [("BOX", (0, 0), (-1, -1), 0.9, colors.black), ("LINEBELOW", (0, 0), (-1, 0), 0.7, colors.black)]
            else:  # ruled
                cmds += [("LINEABOVE", (0, 0), (-1, 0), 1.3, colors.black),
                         ("LINEBELOW", (0, 0), (-1, 0), 0.6, colors.black),
                         ("LINEBELOW", (0, -1), (-1, -1), 1.3, colors.black)]
            if s["shade"]:
                cmds.append(("BACKGROUND", (0, 0), (-1, 0), colors.Color(0.88, 0.88, 0.88)))
            t = Table(rows, style=TableStyle(cmds), hAlign="LEFT")
            flow += [t, Spacer(1, size * 0.6)]
    buf = io.BytesIO()
    doc = SimpleDocTemplate(buf, pagesize=(width, height), leftMargin=s["left"], rightMargin=s["right"],
                            topMargin=s["top"], bottomMargin=s["bottom"], title="", author="", subject="",
                            creator="ocriaquant", producer="ocriaquant", invariant=1)
    doc.build(flow)
    data = buf.getvalue()
    import pypdfium2 as pdfium

    return data, len(pdfium.PdfDocument(data))


def _table_fits(rows, size: float, font: tuple[str, ...], width: float) -> bool:
    from reportlab.pdfbase.pdfmetrics import stringWidth

    pad = 12  # reportlab's default cell padding: 6 pt a side
    cols = len(rows[0])
    need = sum(max(stringWidth(r[ci], font[1] if ri == 0 else font[0], size * 0.95) for ri, r in enumerate(rows)) + pad
               for ci in range(cols))
    return need <= width


def pdf_text_words(pdf: bytes) -> list[str]:
    """The words of a one-page PDF's text layer, in pdfium's order, bullet glyphs left out."""
    import pypdfium2 as pdfium

    doc = pdfium.PdfDocument(pdf)
    text = doc[0].get_textpage().get_text_range()
    return [w for w in text.replace("\r", " ").replace("\n", " ").split() if w not in _BULLET_GLYPHS]


def make_typeset_page(seed: int, size: tuple[int, int] = (512, 640)) -> TypesetPage:
    """One page typeset by reportlab and rasterized by pdfium at 1 px per point; the same seed
    gives the same page. Raises if the PDF's text layer disagrees with the markdown."""
    import pypdfium2 as pdfium

    rng = random.Random(f"typeset-{seed}")
    width, height = size
    s = {
        "body": rng.choices(("Times", "Helvetica", "Courier"), weights=(0.6, 0.32, 0.08))[0],
        "head": rng.choice(("Helvetica", "Helvetica", "Times")),
        "size": rng.choice((12, 13, 13, 14, 14, 15, 16, 17, 18)),
        "leading": rng.uniform(1.15, 1.45),
        "justify": rng.random() < 0.4,
        "center": rng.random() < 0.3,
        "bullet": rng.choice(_BULLET_GLYPHS[:2]),
        "table": rng.choice(("grid", "box", "ruled")),
        "shade": rng.random() < 0.3,
        "left": rng.randint(28, 64), "right": rng.randint(28, 64), "top": rng.randint(24, 56),
        "bottom": rng.randint(24, 56),
    }
    blocks = _blocks(rng, width)
    avail = width - s["left"] - s["right"] - 12
    fam = PDF_FAMILIES[s["body"]]
    blocks = [b for b in blocks if b[0] != "table" or _table_fits(b[1][0], s["size"], fam, avail)]
    # The most blocks from the start that make one page (pages grow with blocks): nothing runs over.
    lo, hi = 0, len(blocks)  # blocks[:lo] fit (none: trivially), blocks[:hi + 1] do not
    built = {}
    while lo < hi:
        mid = (lo + hi + 1) // 2
        built[mid] = _build_pdf(blocks[:mid], width, height, s)
        if built[mid][1] == 1:
            lo = mid
        else:
            hi = mid - 1
    n = lo
    if n == 0:
        raise ValueError(f"seed {seed}: the title alone does not fit a {width}x{height} page")
    pdf, _ = built[n] if n in built else _build_pdf(blocks[:n], width, height, s)
    md = "\n\n".join(b[2] for b in blocks[:n])
    words = pdf_text_words(pdf)
    want = markdown_words(md)
    if words != want:
        bad = next(i for i, (a, b) in enumerate(zip(words + [""] * len(want), want + [""] * len(words))) if a != b)
        raise AssertionError(f"seed {seed}: the PDF's text layer disagrees with the markdown at word {bad}: "
                             f"{words[bad - 2: bad + 3]} vs {want[bad - 2: bad + 3]}")
    page = pdfium.PdfDocument(pdf)[0]
    image = page.render(scale=width / page.get_width()).to_pil().convert("RGB")
    if image.size != (width, height):
        image = image.resize((width, height), Image.LANCZOS)
    return TypesetPage(image=image, markdown=md, seed=seed, pdf=pdf, text_layer_words=tuple(words))


def write_typeset_pages(out_dir: Path, count: int, seed: int = 0, size: tuple[int, int] = (512, 640),
                        prefix: str = "rl", keep_pdf: bool = False) -> list[Path]:
    """Write `count` pages as PNG + sidecar .md (and each PDF under pdf/ with keep_pdf); returns the image paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        page = make_typeset_page(seed * 1_000_003 + i, size)
        stem = out_dir / f"{prefix}-{i:04d}"
        page.image.save(stem.with_suffix(".png"), optimize=True)
        stem.with_suffix(".md").write_text(page.markdown + "\n", encoding="utf-8")
        if keep_pdf:  # beside the pages a PDF would be loaded as a page too: in a subfolder
            (out_dir / "pdf").mkdir(exist_ok=True)
            (out_dir / "pdf" / f"{prefix}-{i:04d}.pdf").write_bytes(page.pdf)
        paths.append(stem.with_suffix(".png"))
    return paths
