"""Pages listed without their pixels: a path and, for a PDF, the page's index. A folder of a
million pages lists in seconds and costs a few hundred bytes a page; the pixels are read later,
one page at a time (`PageReader`), by whoever parses it (data/stream.py's workers, a Ray task),
or all at once by data/load.py's `load_pages` (calibration, eval): the one way pages are found,
images opened and PDF pages rendered.

Local folders, single files, `datasets` imagefolders (metadata.jsonl) and any folder or file
fsspec reads (`s3://bucket/scans`, `gs://…`, `file://…`). A PDF that cannot be opened is
reported here with its path; an image is only opened when it is read, and a page that cannot
be read then is reported by its reader: a bad page never stops the others. Each message ends
with the caller's `hint` (parse: the other pages are parsed; load_pages: pass --skip-bad).

Ground truth is not read while listing, unless asked (`references=True`) for an imagefolder,
whose metadata.jsonl is read anyway: a row's reference column rides on its PageRef. Sidecar
files (NAME.md beside an image) are read per page, when wanted: `sidecar_reference`.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ..errors import OcriaError
from .page import DEFAULT_PROMPT, Page

IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".tif", ".tiff", ".webp"}
PDF_EXTS = {".pdf"}
SIDECAR_EXTS = (".md", ".txt")
# Column names accepted for ground truth in an imagefolder's metadata.jsonl, first present wins.
REFERENCE_COLUMNS = ("markdown", "text", "ground_truth", "reference")
# What an unreadable page's message ends with, after "fix or remove the file": parse's default.
PARSE_HINT = " (the other pages are parsed)"


@dataclass(frozen=True)
class PageRef:
    """One page to read: `path` is a local path or an fsspec URL; `pdf_page` the 0-based page of a
    PDF (None for an image); `name` unique and stable (file name, or "doc.pdf#p3"); `reference`
    an imagefolder row's ground truth, when listed with `references=True`."""
    path: str
    name: str
    pdf_page: int | None = None
    prompt: str = DEFAULT_PROMPT
    reference: str | None = None


@dataclass
class Listing:
    refs: list[PageRef]
    bad: list[tuple[str, str]] = field(default_factory=list)  # (file, reason): files no page could come from
    imagefolder: bool = False  # ground truth from metadata.jsonl, not sidecar files


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


def is_file(path: str) -> bool:
    if is_url(path):
        fs, p = _fs(path)
        return fs.isfile(p)
    return Path(path).is_file()


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


def _pdf_pages(path: str, hint: str) -> int:
    import pypdfium2 as pdfium

    try:
        pdf = pdfium.PdfDocument(read_bytes(path) if is_url(path) else path)
    except (pdfium.PdfiumError, OSError) as e:
        raise OcriaError(f"{path}: cannot open PDF ({e}); fix or remove the file{hint}") from e
    try:
        n = len(pdf)
    finally:
        pdf.close()
    if n == 0:
        raise OcriaError(f"{path}: PDF has no pages; remove the file{hint}")
    return n


def _imagefolder(folder: str, prompt: str, references: bool) -> list[PageRef]:
    """A `datasets` imagefolder's images, from its metadata.jsonl (file_name, optional prompt and,
    with `references`, the first REFERENCE_COLUMNS column the row has)."""
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
        truth = next((row[c] for c in REFERENCE_COLUMNS if row.get(c) is not None), None) if references else None
        refs.append(PageRef(path, _basename(path), None, row.get("prompt") or prompt, truth))
    if not refs:
        raise OcriaError(f"{meta}: empty; an imagefolder needs one row per image")
    return refs


def no_pages_found(source, bad: bool) -> OcriaError:
    """The error for a source with no page (`bad`: it had files, none readable)."""
    what = "readable pages" if bad else "pages"
    return OcriaError(f"{source}: no {what} found (looked for {', '.join(sorted(IMAGE_EXTS | PDF_EXTS))}, "
                      "or metadata.jsonl for an imagefolder)")


def list_pages(source, prompt: str = DEFAULT_PROMPT, *, references: bool = False, hint: str = PARSE_HINT,
               allow_empty: bool = False) -> Listing:
    """Every page of a folder (images, PDFs), a single image or PDF, or an imagefolder, sorted by
    name, without reading pixels. PDFs are opened to count their pages; one that cannot be is in
    `bad`, its message ending with `hint`. `references`: an imagefolder row's ground truth rides
    on its PageRef. No page at all is an error unless `allow_empty`."""
    source = str(source)
    if not _exists(source):
        raise OcriaError(f"{source}: no such file or folder")
    listing = Listing(refs=[])
    if _isdir(source) and _exists(_join(source, "metadata.jsonl")):
        listing.refs, listing.imagefolder = _imagefolder(source, prompt, references), True
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
                n = _pdf_pages(path, hint)
            except OcriaError as e:
                listing.bad.append((path, str(e)))
                continue
            listing.refs += [PageRef(path, f"{_basename(path)}#p{i + 1}", i, prompt) for i in range(n)]
    if not listing.refs and not allow_empty:
        raise no_pages_found(source, bool(listing.bad))
    listing.refs.sort(key=lambda r: r.name)
    return listing


def _read_text(path: str) -> str:
    try:
        text = read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise OcriaError(f"{path}: ground truth is not UTF-8 text ({e}); save it as UTF-8") from e
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as open() reads


def sidecar_reference(ref: PageRef, pdf_pages: int = 1) -> str | None:
    """A page's ground truth from the file beside it, trailing whitespace stripped: NAME.md or
    NAME.txt beside an image; NAME.pN.md (.txt) for page N of a PDF, or, for a PDF of one page
    (`pdf_pages`), NAME.md (.txt). None if there is none."""
    stem = ref.path[: len(ref.path) - len(Path(_basename(ref.path)).suffix)]
    stems = [stem] if ref.pdf_page is None else [f"{stem}.p{ref.pdf_page + 1}"] + ([stem] if pdf_pages == 1 else [])
    for s in stems:
        for ext in SIDECAR_EXTS:
            if is_file(s + ext):
                return _read_text(s + ext).rstrip()
    return None


class PageReader:
    """Reads a PageRef's pixels (a PDF page rendered at `dpi`). Keeps the last PDF open, so the
    pages of one document read in a row open it once. A page that cannot be read is an OcriaError
    naming its file, ending with `hint`."""

    def __init__(self, dpi: int = 150, hint: str = PARSE_HINT):
        self.dpi, self.hint = dpi, hint
        self._pdf = (None, None)  # (path, PdfDocument)

    def read(self, ref: PageRef) -> Page:
        image = self._image(ref) if ref.pdf_page is None else self._render(ref)
        return Page(image=image, source=Path(ref.path), reference=ref.reference, prompt=ref.prompt, name=ref.name)

    def _image(self, ref: PageRef) -> Image.Image:
        try:
            with Image.open(io.BytesIO(read_bytes(ref.path)) if is_url(ref.path) else ref.path) as im:
                im.load()  # decode now: a truncated file fails here, with its path
                return im.convert("RGB")
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise OcriaError(f"{ref.path}: cannot read image ({type(e).__name__}: {e}); fix or remove the file"
                             f"{self.hint}") from e

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
                             f"remove the file{self.hint}") from e

    def close(self) -> None:
        if self._pdf[1] is not None:
            self._pdf[1].close()
        self._pdf = (None, None)
