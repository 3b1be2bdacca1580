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
