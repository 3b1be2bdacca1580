"""Load every page into memory, with its ground truth: a folder of images and PDFs, a single
image or PDF, or a `datasets` imagefolder (a folder with metadata.jsonl). For calibration,
search, eval: a few hundred pages at most (parse streams its pages instead: data/stream.py).

Pages are found by data/listing.py's `list_pages` and read by its `PageReader`, as parse finds
and reads them; this adds the ground truth (sidecar files, or an imagefolder's reference column)
and the policy for bad files. A folder never loses a page silently: a file that cannot be read
is an error naming it, or, with `skip_bad=True`, a warning and a count (`LoadReport.bad`).
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import OcriaError
from .listing import PageReader, is_file, is_url, list_pages, no_pages_found, sidecar_reference
from .page import DEFAULT_PROMPT, Page

# What an unreadable file's message ends with, after "fix or remove the file": every caller of
# load_pages has a --skip-bad.
SKIP_BAD_HINT = ", or pass --skip-bad"


@dataclass
class LoadReport:
    pages: list[Page]
    bad: list[tuple[Path, str]] = field(default_factory=list)  # (file, reason) skipped with skip_bad


def load_pages(source: str | Path, *, dpi: int = 150, skip_bad: bool = False,
               prompt: str = DEFAULT_PROMPT) -> LoadReport:
    """Pages from a folder (images and PDFs, sidecar ground truth), a single image or PDF, or
    a `datasets` imagefolder (a folder with metadata.jsonl). Sorted by name."""
    source = source if is_url(source) else Path(source)
    listing = list_pages(source, prompt, references=True, hint=SKIP_BAD_HINT, allow_empty=True)
    if listing.imagefolder:  # a row naming no file is a wrong metadata.jsonl, not a bad page
        folder = str(source).rstrip("/")
        for ref in listing.refs:
            if not is_file(ref.path):
                raise OcriaError(f"{folder}/metadata.jsonl: names {ref.path[len(folder) + 1:]!r}, which is not in "
                                 f"{folder}; fix its file_name or add the file")
    report = LoadReport(pages=[], bad=[(Path(path), why) for path, why in listing.bad])
    if report.bad and not skip_bad:
        raise OcriaError(report.bad[0][1])  # a PDF that cannot be opened: before any page is decoded
    pdf_pages = Counter(r.path for r in listing.refs if r.pdf_page is not None)
    reader = PageReader(dpi, hint=SKIP_BAD_HINT)
    try:
        for ref in listing.refs:
            try:
                page = reader.read(ref)
            except OcriaError as e:
                if not skip_bad:
                    raise
                report.bad.append((Path(ref.path), str(e)))
                continue
            if not listing.imagefolder:  # an imagefolder's ground truth came with its listing
                page.reference = sidecar_reference(ref, pdf_pages[ref.path])
            report.pages.append(page)
    finally:
        reader.close()
    report.bad.sort(key=lambda b: str(b[0]))
    if report.bad:
        warnings.warn(f"skipped {len(report.bad)} unreadable file(s) in {source}: "
                      + ", ".join(str(p) for p, _ in report.bad[:5]) + (" …" if len(report.bad) > 5 else ""),
                      stacklevel=2)
    if not report.pages:
        raise no_pages_found(source, bool(report.bad))
    return report
