"""Pages listed without pixels (data/listing.py) and read ahead by worker processes
(data/stream.py): every page once, in order, a bounded number encoded at a time, bad pages
reported with their path while the others go on."""

import os
import shutil
import time

import numpy as np
import pytest
from PIL import Image

from ocriaquant.data import BUNDLED_PAGES
from ocriaquant.data.listing import PageReader, list_pages
from ocriaquant.data.stream import stream_pages


class MarkingEncoder:
    """Test encoder: leaves one marker file per page it encodes (created exclusively, so a page
    encoded twice fails), and dies on a page named crash.png as a segfaulting decoder would."""

    def __init__(self, marks):
        self.marks = marks

    def __call__(self):
        def encode(page):
            if page.name == "crash.png":
                os._exit(3)
            open(os.path.join(self.marks, page.name), "x").close()
            return {"pixels": np.asarray(page.image, dtype=np.uint8).copy()}
        return encode


def _folder(tmp_path, n):
    pages = tmp_path / "pages"
    pages.mkdir()
    for i in range(n):
        Image.new("RGB", (40 + i, 30), (i * 7 % 256, 0, 0)).save(pages / f"p{i:02d}.png")
    return pages


def test_listing_reads_no_pixels_and_reports_bad_files(tmp_path):
    pages = _folder(tmp_path, 2)
    Image.new("L", (72, 72), 0).save(pages / "doc.pdf", save_all=True, resolution=72,
                                     append_images=[Image.new("L", (72, 72), 255)])
    (pages / "bad.pdf").write_bytes(b"%PDF-1.4 garbage")
    (pages / "trunc.png").write_bytes((pages / "p00.png").read_bytes()[:40])
    (pages / "notes.txt").write_text("not a page")
    listing = list_pages(pages)
    assert [r.name for r in listing.refs] == ["doc.pdf#p1", "doc.pdf#p2", "p00.png", "p01.png", "trunc.png"]
    assert [(r.pdf_page) for r in listing.refs[:2]] == [0, 1]
    assert [(os.path.basename(p), "cannot open PDF" in e) for p, e in listing.bad] == [("bad.pdf", True)]
    reader = PageReader(dpi=144)
    assert reader.read(listing.refs[1]).image.getpixel((5, 5)) == (255, 255, 255)
    assert reader.read(listing.refs[0]).image.size == (144, 144)  # 72 pt at 144 dpi
    with pytest.raises(Exception, match="trunc.png: cannot read image"):
        reader.read(listing.refs[-1])
    # any fsspec path: the same listing through file://
    assert [r.name for r in list_pages(f"file://{pages}").refs] == [r.name for r in listing.refs]


def test_stream_yields_every_page_once_in_order_with_a_bounded_read_ahead(tmp_path):
    n, workers, ahead = 14, 2, 3
    pages = _folder(tmp_path, n)
    (pages / "p05.png").write_bytes((pages / "p04.png").read_bytes()[:60])  # truncated: fails, the rest go on
    marks = tmp_path / "marks"
    marks.mkdir()
    refs = list_pages(pages).refs
    names, most = [], 0
    for item in stream_pages(refs, MarkingEncoder(str(marks)), workers=workers, ahead=ahead):
        names.append(item.ref.name)
        # While the consumer holds page k, the readers may have encoded up to k + ahead + workers
        # pages (k + 1 yielded, the rest ahead); wait until they get there, and never further.
        bound = min(n, len(names) - 1 + ahead + workers)
        bound -= 5 < bound  # p05 leaves no mark
        t = time.monotonic()
        while len(os.listdir(marks)) < bound and time.monotonic() - t < 30:
            time.sleep(0.02)
        got = len(os.listdir(marks))
        most = max(most, got - len(names))
        assert got <= bound, f"{got} pages encoded while the consumer holds page {len(names) - 1}"
        if item.ref.name == "p05.png":
            assert item.enc is None and "p05.png: cannot read image" in item.error
        else:
            assert item.error is None
            assert item.enc["pixels"].shape == (30, 40 + int(item.ref.name[1:3]), 3)
    assert names == [f"p{i:02d}.png" for i in range(n)]
    assert sorted(os.listdir(marks)) == [f"p{i:02d}.png" for i in range(n) if i != 5]
    assert most >= ahead  # the readers did run ahead of the consumer


def test_a_reader_that_dies_fails_only_its_page(tmp_path):
    pages = _folder(tmp_path, 4)
    shutil.copy(pages / "p00.png", pages / "crash.png")
    marks = tmp_path / "marks"
    marks.mkdir()
    items = list(stream_pages(list_pages(pages).refs, MarkingEncoder(str(marks)), workers=2, ahead=1))
    assert [i.ref.name for i in items] == ["crash.png", "p00.png", "p01.png", "p02.png", "p03.png"]
    assert "reader process died (exit code 3)" in items[0].error and "crash.png" in items[0].error
    assert all(i.error is None for i in items[1:])


def test_the_model_processor_in_a_worker_encodes_as_the_engine_does():
    """The processor run in a reader process gives the request the engine builds in-process,
    mm_token_type_ids included (Qwen3.5 needs them with image inputs), its pixels in the runtime's
    BF16 across the pipe; and the runtime's prompt (vision tower output in place) from those pixels
    is bit for bit the one from the processor's fp32 pixels."""
    import torch

    from ocriaquant.model.load import resolve_model_dir
    from ocriaquant.model.processor import PageEncoder, encode_page, load_processor
    from ocriaquant.runtime.engine import Engine

    refs = list_pages(BUNDLED_PAGES).refs[:2]
    got = list(stream_pages(refs, PageEncoder(resolve_model_dir(None), torch.bfloat16), workers=1))
    engine = Engine()
    for item, ref in zip(got, refs):
        want = engine.encode(PageReader().read(ref))
        assert item.error is None and set(item.enc) == set(want) and "mm_token_type_ids" in want
        assert want["pixel_values"].dtype == torch.bfloat16
        for k in want:
            assert item.enc[k].dtype == want[k].dtype and item.enc[k].equal(want[k]), k
    full = encode_page(load_processor(resolve_model_dir(None)), PageReader().read(refs[0]))
    assert full["pixel_values"].dtype == torch.float32
    a, b = engine.runner.encode([full, got[0].enc])
    assert torch.equal(a.embeds, b.embeds)
