"""Load pages from a folder of images, PDFs, or a `datasets` imagefolder.

A folder never loses a page silently: a file that cannot be read is an error naming it,
or, with `skip_bad=True`, a warning and a count (`LoadReport.bad`).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ..errors import OcriaError
from .page import DEFAULT_PROMPT, Page

IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".tif", ".tiff", ".webp"}
PDF_EXTS = {".pdf"}
SIDECAR_EXTS = (".md", ".txt")
# Column names accepted for ground truth in an imagefolder's metadata.jsonl.
REFERENCE_COLUMNS = ("markdown", "text", "ground_truth", "reference")


@dataclass
class LoadReport:
    pages: list[Page]
    bad: list[tuple[Path, str]] = field(default_factory=list)  # (file, reason) skipped with skip_bad


def _open_image(path: Path) -> Image.Image:
    try:
        with Image.open(path) as im:
            im.load()  # decode now: a truncated file must fail here, not mid-calibration
            # Multi-frame TIFFs: the first frame is the page.
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise OcriaError(f"{path}: cannot read image ({type(e).__name__}: {e}); "
                         "fix or remove the file, or pass --skip-bad") from e


def _sidecar(path: Path) -> str | None:
    for ext in SIDECAR_EXTS:
        side = path.with_suffix(ext)
        if side.is_file():
            return side.read_text(encoding="utf-8").rstrip()
    return None


def render_pdf(path: Path, dpi: int = 150, prompt: str = DEFAULT_PROMPT) -> list[Page]:
    """One Page per PDF page, rendered at `dpi`. Ground truth: a sidecar per page (NAME.pN.md)
    or, for a one-page PDF, NAME.md."""
    import pypdfium2 as pdfium

    try:
        pdf = pdfium.PdfDocument(str(path))
    except (pdfium.PdfiumError, OSError) as e:
        raise OcriaError(f"{path}: cannot open PDF ({e}); fix or remove the file, or pass --skip-bad") from e
    pages = []
    try:
        n = len(pdf)
        if n == 0:
            raise OcriaError(f"{path}: PDF has no pages")
        for i in range(n):
            image = pdf[i].render(scale=dpi / 72).to_pil().convert("RGB")
            ref = _sidecar(path.with_name(f"{path.stem}.p{i + 1}{path.suffix}"))
            if ref is None and n == 1:
                ref = _sidecar(path)
            pages.append(Page(image=image, source=path, reference=ref, prompt=prompt, name=f"{path.name}#p{i + 1}"))
    finally:
        pdf.close()
    return pages


def _load_imagefolder(folder: Path, prompt: str, skip_bad: bool) -> LoadReport:
    """A `datasets` imagefolder: images plus metadata.jsonl with `file_name` and a text column."""
    import datasets

    meta = folder / "metadata.jsonl"
    rows = []
    for lineno, line in enumerate(meta.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise OcriaError(f"{meta}:{lineno}: not valid JSON ({e})") from e
    if not rows:
        raise OcriaError(f"{meta}: empty; an imagefolder needs one row per image")
    for lineno, row in enumerate(rows, 1):
        if "file_name" not in row:
            raise OcriaError(f"{meta}: row {lineno} has no `file_name`")
        if not (folder / row["file_name"]).is_file():
            raise OcriaError(f"{meta}: row {lineno} names {row['file_name']!r}, which is not in {folder}")
    # Let `datasets` read it the way users' pipelines do, but decode images ourselves so a
    # corrupt file is reported by name instead of failing deep inside Arrow.
    ds = datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")
    ds = ds.cast_column("image", datasets.Image(decode=False))
    report = LoadReport(pages=[])
    for ex in ds:
        path = Path(ex["image"]["path"])
        ref = next((ex[c] for c in REFERENCE_COLUMNS if ex.get(c) is not None), None)
        try:
            image = _open_image(path)
        except OcriaError as e:
            if not skip_bad:
                raise
            report.bad.append((path, str(e)))
            continue
        report.pages.append(Page(image=image, source=path, reference=ref, prompt=ex.get("prompt") or prompt,
                                 name=path.name))
    return report


def load_pages(source: str | Path, *, dpi: int = 150, skip_bad: bool = False,
               prompt: str = DEFAULT_PROMPT) -> LoadReport:
    """Pages from a folder (images and PDFs, sidecar ground truth), a single image or PDF, or
    a `datasets` imagefolder (a folder with metadata.jsonl). Sorted by name."""
    source = Path(source)
    if not source.exists():
        raise OcriaError(f"{source}: no such file or folder")
    if source.is_dir() and (source / "metadata.jsonl").is_file():
        report = _load_imagefolder(source, prompt, skip_bad)
    else:
        if source.is_dir():
            files = sorted(p for p in source.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTS | PDF_EXTS)
        elif source.suffix.lower() in IMAGE_EXTS | PDF_EXTS:
            files = [source]
        else:
            raise OcriaError(f"{source}: not an image ({', '.join(sorted(IMAGE_EXTS))}) or PDF")
        report = LoadReport(pages=[])
        for path in files:
            try:
                if path.suffix.lower() in PDF_EXTS:
                    report.pages.extend(render_pdf(path, dpi=dpi, prompt=prompt))
                else:
                    report.pages.append(Page(image=_open_image(path), source=path, reference=_sidecar(path),
                                             prompt=prompt, name=path.name))
            except OcriaError as e:
                if not skip_bad:
                    raise
                report.bad.append((path, str(e)))
    if report.bad:
        warnings.warn(f"skipped {len(report.bad)} unreadable file(s) in {source}: "
                      + ", ".join(str(p) for p, _ in report.bad[:5]) + (" …" if len(report.bad) > 5 else ""),
                      stacklevel=2)
    if not report.pages:
        what = "readable pages" if report.bad else "pages"
        raise OcriaError(f"{source}: no {what} found (looked for {', '.join(sorted(IMAGE_EXTS | PDF_EXTS))}, "
                         "or metadata.jsonl for an imagefolder)")
    report.pages.sort(key=lambda p: p.name)
    return report
