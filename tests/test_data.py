import json
import pytest
from PIL import Image

from ocriaquant.data import BUNDLED_PAGES, load_pages, split_pages
from ocriaquant.data.split import heldout_score, select_split
from ocriaquant.data.synth import GRID_STYLE, SynthStyle, make_page
from ocriaquant.errors import OcriaError


def _img(color=128, size=(64, 80)):
    return Image.new("RGB", size, (color, color, color))


def test_folder_all_image_formats_with_sidecars(tmp_path):
    for i, ext in enumerate(["png", "jpg", "jpeg", "tif", "tiff", "webp"]):
        _img(40 * i).save(tmp_path / f"p{i}.{ext}")
    (tmp_path / "p0.md").write_text("# Zero\n")
    (tmp_path / "p1.txt").write_text("one")
    (tmp_path / "notes.csv").write_text("ignored,file")
    pages = load_pages(tmp_path).pages
    assert [p.name for p in pages] == ["p0.png", "p1.jpg", "p2.jpeg", "p3.tif", "p4.tiff", "p5.webp"]
    by = {p.name: p for p in pages}
    assert by["p0.png"].reference == "# Zero"
    assert by["p1.jpg"].reference == "one"
    assert by["p2.jpeg"].reference is None
    assert all(p.image.mode == "RGB" and p.image.size == (64, 80) for p in pages)
    # Pixels survive the lossless formats exactly.
    assert by["p0.png"].image.getpixel((3, 3)) == (0, 0, 0)
    assert by["p4.tiff"].image.getpixel((3, 3)) == (160, 160, 160)


def test_pdf_pages_rendered_at_dpi(tmp_path):
    pdf = tmp_path / "doc.pdf"
    # A two-page PDF, 144x144 pt pages (PIL writes at 72 dpi: 1 px = 1 pt).
    _img(0, (144, 144)).save(pdf, save_all=True, append_images=[_img(255, (144, 144))], resolution=72)
    (tmp_path / "doc.p2.md").write_text("second page")
    pages = load_pages(tmp_path, dpi=144).pages
    assert [p.name for p in pages] == ["doc.pdf#p1", "doc.pdf#p2"]
    assert pages[0].image.size == (288, 288)  # 2 in at 144 dpi
    assert pages[0].image.getpixel((100, 100))[0] < 30 and pages[1].image.getpixel((100, 100))[0] > 225
    assert pages[0].reference is None and pages[1].reference == "second page"
    assert load_pages(pdf, dpi=72).pages[0].image.size == (144, 144)


def test_imagefolder_with_metadata(tmp_path):
    for i in range(3):
        _img(50 * i).save(tmp_path / f"im{i}.png")
    rows = [{"file_name": f"im{i}.png", "text": f"page {i}"} for i in range(3)]
    (tmp_path / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    pages = load_pages(tmp_path).pages
    assert [(p.name, p.reference) for p in pages] == [(f"im{i}.png", f"page {i}") for i in range(3)]


def test_imagefolder_metadata_naming_missing_file(tmp_path):
    _img().save(tmp_path / "a.png")
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "b.png", "text": "x"}))
    with pytest.raises(OcriaError, match="b.png"):
        load_pages(tmp_path)


@pytest.mark.parametrize("bad_name,content", [("broken.png", b"\x89PNG\r\n\x1a\nnot really"),
                                              ("zero.jpg", b""), ("bad.pdf", b"%PDF-1.4 garbage")])
def test_corrupt_file_is_named_and_skippable(tmp_path, bad_name, content):
    _img().save(tmp_path / "good.png")
    (tmp_path / bad_name).write_bytes(content)
    with pytest.raises(OcriaError, match=bad_name) as exc:
        load_pages(tmp_path)
    assert "--skip-bad" in str(exc.value)
    with pytest.warns(UserWarning, match="skipped 1 unreadable"):
        report = load_pages(tmp_path, skip_bad=True)
    assert [p.name for p in report.pages] == ["good.png"]
    assert [p.name for p, _ in report.bad] == [bad_name]


def test_truncated_png_detected(tmp_path):
    _img(size=(300, 300)).save(tmp_path / "full.png")
    data = (tmp_path / "full.png").read_bytes()
    (tmp_path / "full.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(OcriaError, match="full.png"):
        load_pages(tmp_path)


def test_empty_and_missing_folders(tmp_path):
    with pytest.raises(OcriaError, match="no pages found"):
        load_pages(tmp_path)
    (tmp_path / "readme.txt").write_text("no images here")
    with pytest.raises(OcriaError, match="no pages found"):
        load_pages(tmp_path)
    with pytest.raises(OcriaError, match="no such file"):
        load_pages(tmp_path / "nope")
    (tmp_path / "bad.png").write_bytes(b"junk")
    with pytest.warns(UserWarning), pytest.raises(OcriaError, match="no readable pages"):
        load_pages(tmp_path, skip_bad=True)


def test_split_is_deterministic_balanced_and_stable(tmp_path):
    for i in range(40):
        _img().save(tmp_path / f"s{i:02d}.png")
    pages = load_pages(tmp_path).pages
    calib, held = split_pages(pages)
    calib2, held2 = split_pages(list(reversed(pages)))
    assert {p.name for p in held} == {p.name for p in held2} and len(calib) + len(held) == 40
    assert 8 <= len(held) <= 32
    # Adding pages never moves an existing page across the split.
    for i in range(40, 60):
        _img().save(tmp_path / f"s{i:02d}.png")
    _, held_more = split_pages(load_pages(tmp_path).pages)
    assert {p.name for p in held} == {p.name for p in held_more if p.name < "s40"}
    assert all(0 <= heldout_score(p.name) < 1 for p in pages)
    assert select_split(pages, "all") == pages
    with pytest.raises(ValueError, match="unknown split"):
        select_split(pages, "train")


def test_synth_is_reproducible_and_complete():
    a, b = make_page(11), make_page(11)
    assert a.markdown == b.markdown and a.image.tobytes() == b.image.tobytes()
    assert make_page(12).markdown != a.markdown
    mds = [make_page(s).markdown for s in range(30)]
    assert all(md.startswith("# ") for md in mds)
    assert any("\n## " in md for md in mds)
    assert any("\n- " in md for md in mds)
    assert any("| --- |" in md for md in mds)
    # Every table row has the same number of cells as its header.
    for md in mds:
        for block in md.split("\n\n"):
            if block.startswith("|"):
                assert len({line.count("|") for line in block.splitlines()}) == 1


def test_synth_style_changes_rendering_and_rejects_bad_styles():
    small = make_page(3, SynthStyle(width=384, height=384, font_size=20, heading_size=26, subheading_size=22))
    assert small.image.size == (384, 384)
    assert small.markdown.count("\n\n") < make_page(3).markdown.count("\n\n") + 1
    with pytest.raises(ValueError, match="unknown block kinds"):
        SynthStyle(kinds=("poem",))
    only_tables = make_page(5, SynthStyle(kinds=("table",)))
    assert "| --- |" in only_tables.markdown and "\n- " not in only_tables.markdown


def test_synth_page_text_is_on_the_page():
    """Blocks that do not fit are dropped from the markdown too: the page is never blank below
    the last block's text, and every heading is drawn (dark pixels in its row band)."""
    page = make_page(7)
    gray = page.image.convert("L")
    w, h = gray.size
    rows_with_ink = [y for y in range(h) if min(gray.crop((0, y, w, y + 1)).getdata()) < 128]
    assert rows_with_ink and rows_with_ink[0] < 60 and rows_with_ink[-1] < h - 20


def test_bundled_pages():
    report = load_pages(BUNDLED_PAGES)
    assert len(report.pages) == 128 and all(p.has_reference for p in report.pages)
    calib, held = split_pages(report.pages)
    assert len(calib) >= 48 and len(held) >= 48
    # The committed pages are exactly what the generator draws for their seeds.
    import json

    style = SynthStyle(**{k: tuple(v) if isinstance(v, list) else v
                          for k, v in json.loads((BUNDLED_PAGES / "synth.json").read_text())["style"].items()})
    assert style == GRID_STYLE
    p = make_page(5, style)
    assert (BUNDLED_PAGES / "page-0005.md").read_text().rstrip() == p.markdown
