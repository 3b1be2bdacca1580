import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from ocriaquant.artifacts import load_calibration
from ocriaquant.calibrate import CalibrateOptions, calibrate
from ocriaquant.errors import OcriaError

EVERY_PAGE = CalibrateOptions(max_pages=None, batch_size=2, split="all")


def _run(model_dir, pages, out, **kw):
    return calibrate(model_dir, pages, out, EVERY_PAGE, **kw)


def _same(a, b):
    assert json.loads((a / "sensitivity.json").read_text()) == json.loads((b / "sensitivity.json").read_text())
    sa, sb = load_file(str(a / "stats.safetensors")), load_file(str(b / "stats.safetensors"))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_artifact_contents_and_reuse(tiny_model_dir, synth_pages, tmp_path):
    res = _run(tiny_model_dir, synth_pages, tmp_path / "calib")
    assert not res.reused and res.pages == 6
    meta, sens, stats = load_calibration(tmp_path / "calib")
    assert meta["pages"] == 6 and meta["target_tokens"] > 100
    assert set(sens) == {"h200", "b200"}
    names = [g["name"] for g in meta["groups"] if not g["always_bf16"]]
    assert set(sens["h200"]) == set(names) and "vision" not in sens["h200"]
    for target in ("h200", "b200"):
        for g, v in sens[target].items():
            # 4.5 bits do more damage than 8, on every group.
            assert 0 < v["fp8"] < v["nvfp4"], (target, g, v)
    # W4A4 adds activation error on top of the same NVFP4 weights.
    assert sum(v["nvfp4"] for v in sens["b200"].values()) > sum(v["nvfp4"] for v in sens["h200"].values())
    member = meta["groups"][1]["members"][0]
    assert stats[member + ".act_absmax"].shape == stats[member + ".act_meansq"].shape
    assert (stats[member + ".act_absmax"] ** 2 >= stats[member + ".act_meansq"] * (1 - 1e-5)).all()
    # Same inputs: nothing is recomputed.
    mtime = (tmp_path / "calib" / "stats.safetensors").stat().st_mtime_ns
    assert _run(tiny_model_dir, synth_pages, tmp_path / "calib").reused
    assert (tmp_path / "calib" / "stats.safetensors").stat().st_mtime_ns == mtime


def test_interrupted_run_resumes_to_the_same_result(tiny_model_dir, synth_pages, tmp_path):
    _run(tiny_model_dir, synth_pages, tmp_path / "full")
    part = _run(tiny_model_dir, synth_pages, tmp_path / "resumed", stop_after_batches=1)
    assert part.pages == 2 and not (tmp_path / "resumed").exists()
    assert (tmp_path / "resumed.partial" / "progress.json").exists()
    _run(tiny_model_dir, synth_pages, tmp_path / "resumed")
    assert not (tmp_path / "resumed.partial").exists()
    _same(tmp_path / "full", tmp_path / "resumed")


def test_kill_9_midway_then_rerun(tiny_model_dir, synth_pages, tmp_path):
    code = ("import sys; from ocriaquant.calibrate import calibrate; "
            "calibrate(sys.argv[1], sys.argv[2], sys.argv[3], max_pages=None, batch_size=1, split='all')")
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", code, str(tiny_model_dir), str(synth_pages), str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    progress = tmp_path / "killed.partial" / "progress.json"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if progress.exists() and json.loads(progress.read_text())["done_pages"] >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "calibration finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    calibrate(tiny_model_dir, synth_pages, out, max_pages=None, batch_size=1, split="all")
    calibrate(tiny_model_dir, synth_pages, tmp_path / "clean", max_pages=None, batch_size=1, split="all")
    _same(out, tmp_path / "clean")


def test_pages_without_ground_truth_use_model_output(tiny_model_dir, synth_pages, tmp_path):
    import shutil

    pages = tmp_path / "pages"
    shutil.copytree(synth_pages, pages)
    (pages / "page-0000.md").unlink()
    res = calibrate(tiny_model_dir, pages, tmp_path / "c", CalibrateOptions(max_pages=2, batch_size=2, split="all",
                                                                           max_new_tokens=24))
    assert res.pages == 2


def test_bad_out_and_missing_artifact(tiny_model_dir, synth_pages, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "meta.json").write_text("{}")
    with pytest.raises(OcriaError, match="not a calibration artifact"):
        _run(tiny_model_dir, synth_pages, tmp_path / "taken")
    with pytest.raises(OcriaError, match="run `ocriaquant calibrate`"):
        load_calibration(tmp_path / "nothing")


def test_incomplete_artifact_names_what_is_missing(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "meta.json").write_text("{}")
    (tmp_path / "half" / "sensitivity.json").write_text("{}")
    with pytest.raises(OcriaError, match="no stats.safetensors.*calibrate` again"):
        load_calibration(tmp_path / "half")
    (tmp_path / "half" / "stats.safetensors").write_bytes(b"")
    with pytest.raises(OcriaError, match="lacks the model fingerprint"):
        load_calibration(tmp_path / "half")


def test_artifact_finds_model_and_pages_relative_to_itself_once_moved(tiny_model_dir, synth_pages, tmp_path,
                                                                     monkeypatch):
    """meta.json keeps the model and page folders relative to the artifact, not to the working
    directory of the run: calibrated in one folder with relative paths, then moved (with its model
    and pages) and read from another, it still finds them, and a rerun still reuses it."""
    import shutil

    from ocriaquant.artifacts import calibrated_model, model_fingerprint
    from ocriaquant.data import load_pages

    opts = CalibrateOptions(max_pages=2, batch_size=2, split="all")
    here = tmp_path / "box" / "work"
    shutil.copytree(tiny_model_dir, here / "model")
    shutil.copytree(synth_pages, here / "pages")
    monkeypatch.chdir(here)
    calibrate("model", "pages", "out/calib", opts)
    meta = json.loads((here / "out" / "calib" / "meta.json").read_text())
    assert meta["model_dir"] == os.path.join("..", "..", "model")
    assert meta["pages_dir"] == os.path.join("..", "..", "pages")

    there = tmp_path / "other-machine" / "srv"
    there.parent.mkdir()
    (tmp_path / "box").rename(there)  # the artifact, its model and pages, moved together
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    calib = load_calibration(there / "work" / "out" / "calib")
    assert calib.model_dir.resolve() == (there / "work" / "model").resolve()
    assert calib.pages_dir.resolve() == (there / "work" / "pages").resolve()
    # What search does with it: the model checked by its fingerprint, the held-out pages read.
    assert calibrated_model(calib, there / "work" / "out" / "calib") == calib.model_dir
    assert len(load_pages(calib.pages_dir).pages) == 6
    meta_, sens, stats = calib  # still unpacks as (meta, sensitivity, stats)
    assert meta_ is calib.meta and set(sens) == {"h200", "b200"} and stats

    # Same inputs, other paths and working directory: the fingerprint matches, nothing is recomputed.
    mtime = (there / "work" / "out" / "calib" / "stats.safetensors").stat().st_mtime_ns
    assert calibrate(there / "work" / "model", there / "work" / "pages", there / "work" / "out" / "calib", opts).reused
    assert (there / "work" / "out" / "calib" / "stats.safetensors").stat().st_mtime_ns == mtime

    # The artifact copied without its model: the error says what is missing and where.
    shutil.copytree(there / "work" / "out" / "calib", elsewhere / "calib")
    with pytest.raises(OcriaError, match="its model .*model is not there"):
        calibrated_model(load_calibration(elsewhere / "calib"), elsewhere / "calib")

    # An artifact written before: folders as typed (absolute, or relative to the working directory).
    old = json.loads((elsewhere / "calib" / "meta.json").read_text())
    del old["relative_to"]
    old["model_dir"], old["pages_dir"] = str(there / "work" / "model"), os.path.join("..", "other-machine",
                                                                                      "srv", "work", "pages")
    (elsewhere / "calib" / "meta.json").write_text(json.dumps(old))
    calib = load_calibration(elsewhere / "calib")
    assert calib.model_dir == there / "work" / "model" and calibrated_model(calib, "old") == calib.model_dir
    assert calib.pages_dir.resolve() == (there / "work" / "pages").resolve()
    assert model_fingerprint(calib.model_dir) == calib.model_fingerprint


def test_bundled_model_and_pages_are_named_not_located(tmp_path):
    """The bundled model and pages are stored by name, as in a plan: wherever this install keeps them."""
    from ocriaquant.artifacts import write_calibration
    from ocriaquant.data import BUNDLED_PAGES
    from ocriaquant.model import DEFAULT_MODEL

    meta = {"fingerprint": {"model": "x"}, "pages": 0}
    write_calibration(tmp_path / "calib", meta, {"h200": {}, "b200": {}}, {"w": torch.zeros(1)},
                      model_dir=DEFAULT_MODEL, pages_dir=BUNDLED_PAGES)
    doc = json.loads((tmp_path / "calib" / "meta.json").read_text())
    assert doc["model"] == "bundled" and doc["page_set"] == "bundled"
    assert "model_dir" not in doc and "pages_dir" not in doc
    calib = load_calibration(tmp_path / "calib")
    assert calib.model_dir == DEFAULT_MODEL and calib.pages_dir == BUNDLED_PAGES


def test_library_output_inside_the_bar_goes_to_the_log(tiny_model_dir, synth_pages, tmp_path, monkeypatch, capsys):
    """rich's Progress must not redirect sys.stdout / sys.stderr: on a terminal it would print a
    library's bar (tqdm) above ours instead of letting logs.quiet send it to the log file."""
    from rich.console import Console

    import ocriaquant.calibrate as calibrate_module
    from ocriaquant.logs import LOG_NAME, quiet

    real = calibrate_module.target_logits

    def chatty(*args, **kwargs):
        print("tqdm-like bar on stdout")
        print("tqdm-like bar on stderr", file=sys.stderr)
        return real(*args, **kwargs)

    monkeypatch.setattr(calibrate_module, "target_logits", chatty)
    console = Console(stderr=True, force_terminal=True)
    with quiet(tmp_path / LOG_NAME, consoles=[console]):
        calibrate(tiny_model_dir, synth_pages, tmp_path / "calib", CalibrateOptions(max_pages=1, batch_size=1,
                                                                                   split="all"), console=console)
    captured = capsys.readouterr()
    assert "tqdm-like" not in captured.out + captured.err
    log = (tmp_path / LOG_NAME).read_text()
    assert "tqdm-like bar on stdout" in log and "tqdm-like bar on stderr" in log


def test_a_pass_out_of_memory_goes_on_with_fewer_pages_and_counts_nothing_twice(tiny_model_dir, synth_pages,
                                                                                tmp_path, monkeypatch):
    """A pass that runs out of memory after its forward hooks have counted gives its statistics back and
    is run again with half the pages, down to one: the artifact is the one-page-a-pass run's, bit for
    bit. Out of memory on one page is an error that names it."""
    import ocriaquant.calibrate as cal

    calibrate(tiny_model_dir, synth_pages, tmp_path / "one", EVERY_PAGE, batch_size=1)
    real = cal.target_logits

    def tight(net, inputs, tpos):
        logits = real(net, inputs, tpos)  # the forward hooks have counted this pass
        if inputs["input_ids"].shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return logits

    monkeypatch.setattr(cal, "target_logits", tight)
    calibrate(tiny_model_dir, synth_pages, tmp_path / "four", EVERY_PAGE, batch_size=4)
    _same(tmp_path / "one", tmp_path / "four")

    # after a pass has been saved: the statistics go back to the saved state (the pair of pages it holds
    # batched in one pass: equal up to the model's fp32 rounding; counted twice they would not be)
    calls = []

    def late(net, inputs, tpos):
        logits = real(net, inputs, tpos)
        calls.append(inputs["input_ids"].shape[0])
        if len(calls) == 2 and calls[-1] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return logits

    monkeypatch.setattr(cal, "target_logits", late)
    calibrate(tiny_model_dir, synth_pages, tmp_path / "late", EVERY_PAGE, batch_size=2)
    assert calls == [2, 2, 1, 1, 1, 1]
    sa, sb = load_file(str(tmp_path / "one" / "stats.safetensors")), load_file(str(tmp_path / "late" / "stats.safetensors"))
    assert sa.keys() == sb.keys() and all(torch.allclose(sa[k], sb[k], rtol=1e-4, atol=1e-9) for k in sa)

    monkeypatch.setattr(cal, "target_logits", lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError("simulated")))
    with pytest.raises(OcriaError, match="one page does not fit"):
        calibrate(tiny_model_dir, synth_pages, tmp_path / "none", EVERY_PAGE, batch_size=2)
