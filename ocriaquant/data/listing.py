"""Pages listed without their pixels: a path and, for a PDF, the page's index. A folder of a
million pages lists in seconds and costs a few hundred bytes a page; the pixels are read later,
one page at a time (`PageReader`), by whoever parses it (data/stream.py's workers, a Ray task).

Local folders, single files, `datasets` imagefolders (metadata.jsonl) and any folder or file
fsspec reads (`s3://bucket/scans`, `gs://…`, `file://…`). A PDF that cannot be opened is
reported here with its path; an image is only opened when it is read, and a page that cannot
be read then is reported by its reader: a bad page never stops the others.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ..errors import OcriaError
from .load import IMAGE_EXTS, PDF_EXTS
from .page import DEFAULT_PROMPT, Page


@dataclass(frozen=True)
class PageRef:
    """One page to read: `path` is a local path or an fsspec URL; `pdf_page` the 0-based page of a
    PDF (None for an image); `name` unique and stable (file name, or "doc.pdf#p3")."""
    path: str
    name: str
    pdf_page: int | None = None
    prompt: str = DEFAULT_PROMPT


@dataclass
class Listing:
    refs: list[PageRef]
    bad: list[tuple[str, str]] = field(default_factory=list)  # (file, reason): files no page could come from


def is_url(path) -> bool:
    return "://" in str(path)


def _fs(url: str):
    import fsspec

    return fsspec.core.url_to_fs(url)  # (filesystem, path without its protocol)


def read_bytes(path: str) -> bytes:
    if is_url(path):
        fs, p = _fs(path)
        return fs.cat_file(p)
    return Path(path).read_bytes()


def _exists(path: str) -> bool:
    if is_url(path):
        fs, p = _fs(path)
        return fs.exists(p)
    return Path(path).exists()


def _isdir(path: str) -> bool:
    if is_url(path):
        fs, p = _fs(path)
        return fs.isdir(p)
    return Path(path).is_dir()


def _files(folder: str) -> list[str]:
    """The folder's files (not recursive) as paths of the same kind as `folder`."""
    if is_url(folder):
        fs, p = _fs(folder)
        return [fs.unstrip_protocol(f["name"]) for f in fs.ls(p, detail=True) if f.get("type") == "file"]
    return [str(f) for f in Path(folder).iterdir() if f.is_file()]


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}" if is_url(folder) else str(Path(folder) / name)


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _suffix(path: str) -> str:
    return Path(_basename(path)).suffix.lower()


def _pdf_pages(path: str) -> int:
    import pypdfium2 as pdfium

    try:
        pdf = pdfium.PdfDocument(read_bytes(path) if is_url(path) else path)
    except (pdfium.PdfiumError, OSError) as e:
        raise OcriaError(f"{path}: cannot open PDF ({e}); fix or remove the file (the other pages are parsed)") from e
    try:
        n = len(pdf)
    finally:
        pdf.close()
    if n == 0:
        raise OcriaError(f"{path}: PDF has no pages; remove the file")
    return n


def _imagefolder(folder: str, prompt: str) -> list[PageRef]:
    """A `datasets` imagefolder's images, from its metadata.jsonl (file_name, optional prompt)."""
    meta = _join(folder, "metadata.jsonl")
    refs = []
    for lineno, line in enumerate(read_bytes(meta).decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise OcriaError(f"{meta}:{lineno}: not valid JSON ({e})") from e
        if "file_name" not in row:
            raise OcriaError(f"{meta}: row {lineno} has no `file_name`")
        path = _join(folder, row["file_name"])
        refs.append(PageRef(path, _basename(path), None, row.get("prompt") or prompt))
    if not refs:
        raise OcriaError(f"{meta}: empty; an imagefolder needs one row per image")
    return refs


def list_pages(source, prompt: str = DEFAULT_PROMPT) -> Listing:
    """Every page of a folder (images, PDFs), a single image or PDF, or an imagefolder, sorted by
    name, without reading pixels. PDFs are opened to count their pages."""
    source = str(source)
    if not _exists(source):
        raise OcriaError(f"{source}: no such file or folder")
    listing = Listing(refs=[])
    if _isdir(source) and _exists(_join(source, "metadata.jsonl")):
        listing.refs = _imagefolder(source, prompt)
    else:
        if _isdir(source):
            files = sorted(f for f in _files(source) if _suffix(f) in IMAGE_EXTS | PDF_EXTS)
        elif _suffix(source) in IMAGE_EXTS | PDF_EXTS:
            files = [source]
        else:
            raise OcriaError(f"{source}: not an image ({', '.join(sorted(IMAGE_EXTS))}) or PDF")
        for path in files:
            if _suffix(path) not in PDF_EXTS:
                listing.refs.append(PageRef(path, _basename(path), None, prompt))
                continue
            try:
                n = _pdf_pages(path)
            except OcriaError as e:
                listing.bad.append((path, str(e)))
                continue
            listing.refs += [PageRef(path, f"{_basename(path)}#p{i + 1}", i, prompt) for i in range(n)]
    if not listing.refs:
        what = "readable pages" if listing.bad else "pages"
        raise OcriaError(f"{source}: no {what} found (looked for {', '.join(sorted(IMAGE_EXTS | PDF_EXTS))}, "
                         "or metadata.jsonl for an imagefolder)")
    listing.refs.sort(key=lambda r: r.name)
    return listing


class PageReader:
    """Reads a PageRef's pixels (a PDF page rendered at `dpi`). Keeps the last PDF open, so the
    pages of one document read in a row open it once."""

    def __init__(self, dpi: int = 150):
        self.dpi = dpi
        self._pdf = (None, None)  # (path, PdfDocument)

    def read(self, ref: PageRef) -> Page:
        image = self._image(ref) if ref.pdf_page is None else self._render(ref)
        return Page(image=image, source=Path(ref.path), prompt=ref.prompt, name=ref.name)

    def _image(self, ref: PageRef) -> Image.Image:
        try:
            with Image.open(io.BytesIO(read_bytes(ref.path)) if is_url(ref.path) else ref.path) as im:
                im.load()  # decode now: a truncated file fails here, with its path
                return im.convert("RGB")
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise OcriaError(f"{ref.path}: cannot read image ({type(e).__name__}: {e}); fix or remove the file "
                             "(the other pages are parsed)") from e

    def _render(self, ref: PageRef) -> Image.Image:
        import pypdfium2 as pdfium

        try:
            if self._pdf[0] != ref.path:
                self.close()
                self._pdf = (ref.path, pdfium.PdfDocument(read_bytes(ref.path) if is_url(ref.path) else ref.path))
            page = self._pdf[1][ref.pdf_page]
            try:
                return page.render(scale=self.dpi / 72).to_pil().convert("RGB")
            finally:
                page.close()
        except (pdfium.PdfiumError, OSError, IndexError) as e:
            raise OcriaError(f"{ref.path}: cannot render page {ref.pdf_page + 1} ({type(e).__name__}: {e}); fix or "
                             "remove the file (the other pages are parsed)") from e

    def close(self) -> None:
        if self._pdf[1] is not None:
            self._pdf[1].close()
        self._pdf = (None, None)
