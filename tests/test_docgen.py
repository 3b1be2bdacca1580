"""Document pages (issue #57): our generator, the second renderer, the reader's tokenizer and MTP
layer, GDN training implementations, the training script's pack, and a tiny run of the training
script itself (~30 s on two cores)."""

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ocriaquant.data import load_pages
from ocriaquant.data.docgen import DOC_STYLE, DocStyle, make_doc_page, markdown_words, vocabulary
from ocriaquant.data.synth import GRID_STYLE, make_page, write_pages

ROOT = Path(__file__).resolve().parents[1]
SMALL = dataclasses.replace(DOC_STYLE, sizes=((320, 400),), size_weights=None, font_px=(10, 14), max_chars=500)
OLD_WORDS = set(
    "the of and to in is for on that with as by this are from be at or an it not which data model page report table "
    "value total result method system time rate cost sample test group layer level price order number line text "
    "figure section summary account annual quarter market sales income growth revenue profit budget review policy "
    "project design energy water health school city north south east west first second final new small large high "
    "low early late open closed public private local global average mean index share unit part note item record field "
    "input output source target service client".split())


def test_same_seed_same_page_and_different_seeds_differ():
    a, b, c = make_doc_page(3, SMALL), make_doc_page(3, SMALL), make_doc_page(4, SMALL)
    assert a.markdown == b.markdown and np.array_equal(np.asarray(a.image), np.asarray(b.image))
    assert a.markdown != c.markdown
    # synth.make_page takes a DocStyle too (the grid style stays selectable)
    assert make_page(3, SMALL).markdown == a.markdown
    assert make_page(3, GRID_STYLE).image.size == (512, 512)


@pytest.mark.parametrize("style", [DOC_STYLE, SMALL, dataclasses.replace(DOC_STYLE, scan=False, emphasis=False)],
                         ids=["default", "small", "clean"])
def test_markdown_holds_exactly_the_words_drawn(style):
    for seed in range(6):
        page = make_doc_page(seed, style)
        assert markdown_words(page.markdown) == list(page.drawn), seed
        assert page.image.size in style.sizes and page.image.mode == "RGB"


def test_markdown_structure():
    kinds = set()
    for seed in range(20):
        md = make_doc_page(seed, SMALL if seed % 2 else DOC_STYLE).markdown
        assert md == md.strip() and "\n\n\n" not in md
        for block in md.split("\n\n"):
            lines = block.split("\n")
            if block.startswith("#"):
                kinds.add("heading")
                assert re.match(r"#{1,3} \S", block) and len(lines) == 1
            elif block.startswith("|"):
                kinds.add("table")
                ncol = lines[0].count("|")
                assert re.fullmatch(r"\|(---\|)+", lines[1]) and lines[1].count("|") == ncol
                assert all(ln.count("|") == ncol for ln in lines) and len(lines) >= 3
            elif block.startswith("- "):
                kinds.add("list")
                assert all(ln.startswith("- ") for ln in lines)
            elif re.match(r"1\. ", block):
                kinds.add("numbered")
                assert [int(ln.split(".")[0]) for ln in lines] == list(range(1, len(lines) + 1))
            else:
                kinds.add("paragraph")
                assert len(lines) == 1  # a paragraph's lines are joined
                assert not re.match(r"\d+[.)] ", block)
    assert kinds == {"heading", "table", "list", "numbered", "paragraph"}


def test_open_vocabulary_numbers_dates_and_faces():
    v = vocabulary()
    assert sum(len(x) for x in v.values()) > 40_000 and {"l10", "l20", "l35", "names"} <= set(v)
    words, text = set(), []
    for seed in range(12):
        md = make_doc_page(seed).markdown
        text.append(md)
        words |= {w.strip(".,;:!?()\"*").lower() for w in markdown_words(md)}
    assert len(words - OLD_WORDS) > 800
    joined = "\n".join(text)
    assert re.search(r"\d{1,3},\d{3}", joined) and re.search(r"\d+(\.\d+)?%", joined)
    assert re.search(r"(19|20)\d\d-\d\d-\d\d|\d\d/\d\d/(19|20)\d\d|[A-Z][a-z]+ \d{1,2}, (19|20)\d\d", joined)
    assert "**" in joined and re.search(r"(?<!\*)\*[^*\s][^*]*\*(?!\*)", joined)


def test_pages_vary_in_size_font_and_paper():
    sizes, papers = set(), set()
    for seed in range(16):
        img = np.asarray(make_doc_page(seed).image)
        sizes.add(img.shape[:2])
        papers.add(tuple(np.median(img.reshape(-1, 3), axis=0).astype(int)))
    assert len(sizes) == 3 and len(papers) > 8


def test_written_doc_pages_load_with_their_markdown(tmp_path):
    paths = write_pages(tmp_path, 3, seed=2, style=SMALL)
    pages = load_pages(tmp_path).pages
    assert [p.name for p in pages] == [p.name for p in paths]
    assert pages[1].reference == make_doc_page(2 * 1_000_003 + 1, SMALL).markdown
    assert DocStyle.from_dict(json.loads(json.dumps(dataclasses.asdict(DOC_STYLE)))) == DOC_STYLE
    jpegs = write_pages(tmp_path / "jpeg", 3, seed=2, style=SMALL, jpeg_quality=85)  # the bundled pages' format
    loaded = load_pages(tmp_path / "jpeg").pages
    assert [p.name for p in loaded] == [p.name for p in jpegs] and jpegs[0].suffix == ".jpg"
    assert [p.reference for p in loaded] == [p.reference for p in pages]
    png, jpg = (np.asarray(Image.open(p).convert("RGB"), dtype=float) for p in (paths[0], jpegs[0]))
    assert png.shape == jpg.shape and np.abs(png - jpg).mean() < 4  # the same page, lossy


def test_markdown_words():
    md = "# Title 2024\n\n**Note:** a *b c* d.\n\n- one\n- two\n\n1. x\n2. y\n\n| A | B |\n|---|---|\n| **Total** | 1,2 |"
    assert markdown_words(md) == ["Title", "2024", "Note:", "a", "b", "c", "d.", "one", "two", "1.", "x", "2.", "y",
                                  "A", "B", "Total", "1,2"]


# --- the second renderer -----------------------------------------------------------------------

def test_second_renderer_page_matches_its_pdf_text_layer(tmp_path):
    pytest.importorskip("reportlab")
    from ocriaquant.data.typeset import make_typeset_page, pdf_text_words, write_typeset_pages

    for seed in range(4):
        page = make_typeset_page(seed)
        assert page.image.size == (512, 640)
        assert list(page.text_layer_words) == markdown_words(page.markdown) == pdf_text_words(page.pdf)
        ink = (np.asarray(page.image.convert("L")) < 128).mean()
        assert 0.005 < ink < 0.3  # text on the page, not a blank or black raster
        assert b"/FontFile" not in page.pdf  # PDF standard fonts, not embedded: pdfium's own faces draw them
        assert re.search(rb"/BaseFont /(Times|Helvetica|Courier)", page.pdf)
    assert make_typeset_page(1).markdown == make_typeset_page(1).markdown
    assert "|---|" in "\n".join(make_typeset_page(s).markdown for s in range(8))  # tables among them
    write_typeset_pages(tmp_path, 2, seed=3, keep_pdf=True)
    pages = load_pages(tmp_path).pages
    assert [p.name for p in pages] == ["rl-0000.png", "rl-0001.png"] and all(p.reference for p in pages)
    assert (tmp_path / "pdf" / "rl-0001.pdf").exists()


def test_make_pages_script_both_renderers(tmp_path):
    pytest.importorskip("reportlab")
    for extra in (["--style", "doc", "--sizes", "320x400", "--font-px", "10-14"], ["--renderer", "reportlab"]):
        out = tmp_path / extra[1]
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_pages.py"), "--out", str(out), "--count", "2",
                        "--seed", "5", *extra], check=True, capture_output=True)
        assert len(load_pages(out).pages) == 2 and (out / "synth.json").exists()


# --- the reader: tokenizer, MTP layer, GDN implementations ---------------------------------------

@pytest.fixture(scope="module")
def reader_tok():
    from ocriaquant.model.reader import train_reader_tokenizer

    return train_reader_tokenizer([make_doc_page(s, SMALL).markdown for s in range(40)], vocab_size=600)


def test_reader_tokenizer_round_trips_and_keeps_qwen_specials(reader_tok):
    tok = reader_tok
    assert type(tok).__name__ == "Qwen3_5Tokenizer" and len(tok) <= 600
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    for s in range(40, 46):
        md = make_doc_page(s).markdown
        ids = tok(md)["input_ids"]
        assert tok.decode(ids) == md and len(ids) < 0.8 * len(md.encode())  # merges, unlike the byte tokenizer
    assert tok.decode(tok("Ωμ ≥ €5 ✓")["input_ids"]) == "Ωμ ≥ €5 ✓"  # any byte string still encodes
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                                              add_generation_prompt=True)


MTP_NAMES = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
             "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight",
             "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.k_proj.weight",
             "mtp.layers.0.self_attn.v_proj.weight", "mtp.layers.0.self_attn.o_proj.weight",
             "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.k_norm.weight",
             "mtp.layers.0.mlp.gate_proj.weight", "mtp.layers.0.mlp.up_proj.weight",
             "mtp.layers.0.mlp.down_proj.weight"}  # vLLM's qwen3_5_mtp (after its mtp. -> model. rename)


def test_reader_with_mtp_saves_loads_and_runs(reader_tok, tmp_path):
    from safetensors import safe_open

    from ocriaquant.model.load import load_model
    from ocriaquant.model.mtp import Qwen35MTP, load_mtp
    from ocriaquant.model.reader import ReaderShape, count_parameters, init_reader, reader_config
    from ocriaquant.runtime.load import TensorStore

    counts = count_parameters(reader_config(reader_tok, ReaderShape(vocab=8192)))
    assert counts["total"] * 2 <= 40e6 and counts["mtp"] > 0  # the real reader: <= 40 MB of BF16 with its MTP layer
    shape = ReaderShape(hidden=64, intermediate=128, layers=4, attn_heads=2, kv_heads=1, head_dim=32, gdn_k_heads=1,
                        gdn_v_heads=2, gdn_head_dim=32, vision_depth=1, vision_hidden=64, vision_intermediate=128,
                        vision_heads=2, vocab=600)
    out = init_reader(tmp_path / "reader", reader_tok, shape)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {k for k in index if k.startswith("mtp.")} == MTP_NAMES
    with safe_open(str(out / "model-mtp.safetensors"), "pt") as fh:
        assert all(fh.get_tensor(k).dtype == torch.bfloat16 for k in fh.keys())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1
    model, proc = load_model(out, dtype="fp32")  # transformers ignores mtp.*
    assert not any(n.startswith("mtp") for n, _ in model.named_parameters())
    assert "mtp.fc.weight" in TensorStore(out)  # our runtime sees it (export carries it)
    mtp = load_mtp(out, model.config.text_config)
    assert isinstance(mtp, Qwen35MTP)
    lm = model.model.language_model
    emb = torch.randn(2, 7, 64)
    cos_sin = lm.rotary_emb(emb, torch.arange(7)[None, None].expand(3, 2, 7))
    y = mtp(emb, torch.randn(2, 7, 64), cos_sin)
    assert y.shape == (2, 7, 64)
    # causal: the first positions do not see later ones
    emb2 = emb.clone()
    emb2[:, 5:] += 1
    y2 = mtp(emb2, torch.zeros(2, 7, 64), cos_sin)
    y1 = mtp(emb, torch.zeros(2, 7, 64), cos_sin)
    assert torch.allclose(y1[:, :5], y2[:, :5], atol=1e-5) and not torch.allclose(y1[:, 5:], y2[:, 5:])


def test_gdn_training_implementation_on_cpu_is_transformers_torch_function():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from ocriaquant.model import gdn_train

    name, report = gdn_train.select(2, 16, "cpu")
    assert name == "torch" and report["torch"]["ok"]
    old = m.torch_chunk_gated_delta_rule
    try:
        gdn_train.install("torch")
        assert m.torch_chunk_gated_delta_rule is gdn_train.torch_reference()
    finally:
        m.torch_chunk_gated_delta_rule = old
    with pytest.raises(ValueError, match="unknown GDN"):
        gdn_train.implementation("nope")


def _train_script():
    spec = importlib.util.spec_from_file_location("train_reference", ROOT / "scripts" / "train_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pack_round_trips_bf16_weights(tmp_path, monkeypatch):
    tr = _train_script()
    monkeypatch.setattr(tr, "PACK_PART", 1000)  # several parts
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(30, 20, generator=g) * 0.02, "b": torch.randn(7, generator=g),
               "mtp.fc.weight": torch.randn(4, 8, generator=g)}
    tr.save_pack(tmp_path / "pack", tensors, {"steps": 3})
    assert len(list((tmp_path / "pack").glob("pack.*"))) > 1
    got, meta = tr.load_pack(tmp_path / "pack")
    assert meta["steps"] == 3
    assert all(torch.equal(got[k], tensors[k].to(torch.bfloat16)) for k in tensors)


def test_page_pool_skips_a_page_the_generator_fails_on(monkeypatch):
    """A generator bug on one seed costs that page, not the GPU run: the pool leaves it out and keeps its seed
    and error for the log; held-out pages still fail loudly."""
    from concurrent.futures import ThreadPoolExecutor

    tr = _train_script()
    real = tr.make_doc_page
    bad = tr.TRAIN_SEED_BASE + 2

    def flaky(seed, style):
        if seed in (bad, 1):
            raise IndexError("list index out of range")
        return real(seed, style)

    monkeypatch.setattr(tr, "make_doc_page", flaky)
    stream = tr.PageStream(0, [SMALL], [1.0])
    with ThreadPoolExecutor(2) as ex:
        pool = tr.PagePool(stream, [(320, 400)], [8], ex, torch.device("cpu"), 0, in_flight=5)
        pool.submit()
        got = pool.collect(block=True)
        assert [seed for _, seed, _, _ in got] == [tr.TRAIN_SEED_BASE + i for i in (0, 1, 3, 4)]
        assert pool.failed == [(bad, "IndexError: list index out of range")]
        with pytest.raises(SystemExit, match="held-out page 1"):
            tr.held_out_pages(2, SMALL, ex)


def test_train_script_smoke_resume_and_eval(tmp_path):
    """A tiny reader trains a few steps on the CPU, resumes (same machine and from a pack), and the
    model it writes loads and is scored by `ocriaquant eval`."""
    script = str(ROOT / "scripts" / "train_reference.py")
    common = ["--device", "cpu", "--workers", "1", "--pool", "8", "--eval-pages", "1", "--eval-every", "0",
              "--log-every", "1"]
    first = ["--tiny", "--sizes", "256x320", "--size-weights", "1", "--font-px", "8-12", "--max-chars", "300",
             "--batch", "2", "--tokenizer-pages", "8"]
    run = lambda *a: subprocess.run([sys.executable, script, *a], check=True, capture_output=True, text=True)  # noqa: E731
    run("--work", str(tmp_path / "w"), "--steps", "2", *first, *common)
    run("--work", str(tmp_path / "w"), "--resume", "--steps", "3", *common)
    run("--work", str(tmp_path / "w2"), "--resume-from", str(tmp_path / "w" / "pack"), "--steps", "4",
        "--out", str(tmp_path / "model"), "--save-minutes", "0", *common)
    log = [json.loads(ln) for ln in (tmp_path / "w2" / "log.jsonl").read_text().splitlines()]
    assert log[0]["event"] == "start" and log[0]["step"] == 3 and [r["step"] for r in log if "ce" in r] == [4]
    assert [r["step"] for r in log if r.get("event") == "saved"] == [4, 4]  # --save-minutes 0: every step, and the end
    write_pages(tmp_path / "pages", 1, seed=9, style=dataclasses.replace(SMALL, sizes=((256, 320),)))
    res = subprocess.run([sys.executable, "-m", "ocriaquant", "eval", str(tmp_path / "model"), "--pages",
                          str(tmp_path / "pages"), "--split", "all", "--max-new-tokens", "8"], capture_output=True,
                         text=True, cwd=tmp_path)
    assert res.returncode == 0 and "NED" in res.stdout and "worst pages:" in res.stdout


def test_one_word_titles_may_be_a_connector():
    """A one-word title whose word is a connector ("on", "for": common words of the vocabulary) is kept, not
    popped to nothing (the first GPU training run died on such a table header)."""
    import random

    from ocriaquant.data.docgen import TextSource

    connectors = {"of", "and", "for", "in", "to", "&", "on"}
    src = TextSource(random.Random(0))
    titles = [src.title(1, 1) for _ in range(20000)]  # ~1 in 1,000 draws is a connector
    assert all(titles), "an empty title"
    assert any(t.split()[0].lower() in connectors for t in titles), "no draw exercised a connector title"


def test_a_draw_where_nothing_fits_is_drawn_again_deterministically(monkeypatch):
    """Large type on a small page can leave no block that fits (seed 1,008,460 at 640×832, body 22 px): that draw is
    redrawn from a derived seed, the same each time, instead of failing."""
    from ocriaquant.data import docgen

    real, calls = docgen._layout_page, []

    def first_fails(seed, style, width, height, rng):
        calls.append(rng.random())  # which stream this attempt draws from
        if len(calls) % 2 == 1:
            raise docgen.NothingFits("nothing fits")
        return real(seed, style, width, height, rng)

    monkeypatch.setattr(docgen, "_layout_page", first_fails)
    a, b = make_doc_page(5, SMALL), make_doc_page(5, SMALL)
    assert a.markdown == b.markdown and np.array_equal(np.asarray(a.image), np.asarray(b.image))
    assert calls[0] != calls[1] and calls[:2] == calls[2:]  # attempt 1 draws another stream, the same both times
    monkeypatch.setattr(docgen, "_layout_page", lambda *a: (_ for _ in ()).throw(docgen.NothingFits("never")))
    with pytest.raises(docgen.NothingFits):
        make_doc_page(5, SMALL)
