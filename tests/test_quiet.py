"""Quiet by default: the libraries' logs, warnings and progress bars go to ocriaquant.log beside
the outputs; the terminal keeps our lines, our own warnings and one explanation per library
warning we cannot fix (ocriaquant/logs.py, issue #58)."""

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import warnings

from rich.console import Console

from ocriaquant.logs import EXPLAINED, LOG_NAME, quiet

OFFLOAD = "Attempting to save a model with offloaded modules. Ensure that unallocated cpu memory exceeds 50GB"
FALLBACK = ("`chunk_gated_delta_rule` is falling back to its reference PyTorch implementation because "
            "`flash-linear-attention` is not installed.")


def _third_party_warning(text: str) -> None:
    """warnings.warn called from a module that is not ours."""
    ns = {"__name__": "somelib"}
    exec(compile(f"import warnings\ndef f():\n    warnings.warn({text!r})\n", "somelib.py", "exec"), ns)
    ns["f"]()


def test_every_library_channel_goes_to_the_log_and_ours_to_the_terminal(tmp_path, synth_pages, monkeypatch):
    from loguru import logger as loguru
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    from ocriaquant.data import load_pages

    pages = tmp_path / "pages"
    shutil.copytree(synth_pages, pages)
    (pages / "broken.png").write_bytes(b"not a png")
    term_out, term_err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", term_out)
    monkeypatch.setattr(sys, "stderr", term_err)
    ours, ours_err = Console(width=200), Console(stderr=True, width=200)
    hf = hf_logging.get_logger("transformers.fake")
    hf_handlers = [h for h in logging.getLogger("transformers").handlers if type(h) is logging.StreamHandler]
    streams_before = [h.stream for h in hf_handlers]
    assert hf_handlers
    log_path = tmp_path / "out" / LOG_NAME
    logged = []

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with quiet(log_path, title="test", consoles=(ours, ours_err), note=lambda t: ours_err.print(f"note: {t}"),
                   warn=lambda t: ours_err.print(f"warning: {t}"), done=logged.append):
            ours.print("our result line")
            logging.getLogger("somelib").warning("somelib logging line")
            hf.warning(FALLBACK)
            hf.warning(FALLBACK)  # explained once
            loguru.warning("loguru line")
            _third_party_warning(OFFLOAD)
            print("a stray print")
            for _ in tqdm(range(3), desc="library bar"):
                pass
            report = load_pages(pages, skip_bad=True)  # our own warning: a skipped page
    assert report.bad

    terminal = term_out.getvalue() + term_err.getvalue()
    assert "our result line" in term_out.getvalue()
    assert "warning: skipped 1 unreadable file(s)" in terminal and "broken.png" in terminal
    explain = dict(EXPLAINED)
    assert terminal.count("note: ") == 2
    assert explain["falling back to its reference PyTorch implementation"] in terminal
    assert explain["save a model with offloaded modules"] in terminal
    for noise in ("somelib logging line", "loguru line", "falling back", "offloaded modules", "a stray print",
                  "library bar", "it/s"):
        assert noise not in terminal, noise

    log = log_path.read_text()
    assert "ocriaquant test" in log.splitlines()[1]  # one header per run
    for line in ("somelib logging line", "[transformers] " + FALLBACK, "loguru line", OFFLOAD, "a stray print",
                 "library bar"):
        assert line in log, line
    assert "skipped 1 unreadable" not in log and "our result line" not in log
    assert len(logged) == 1 and logged[0].path == log_path

    # Everything is as it was: the streams, transformers' handler, warnings, loguru.
    assert sys.stdout is term_out and sys.stderr is term_err
    assert [h.stream for h in hf_handlers] == streams_before
    print("after")
    assert "after" in term_out.getvalue() and "after" not in log_path.read_text()


def test_verbose_routes_nothing_and_a_silent_run_writes_no_log(tmp_path, capsys):
    with quiet(tmp_path / "a" / LOG_NAME, verbose=True) as log:
        print("library says")
    assert log is None and "library says" in capsys.readouterr().out
    assert not (tmp_path / "a").exists()
    with quiet(tmp_path / "b" / LOG_NAME) as log:
        pass
    assert log.chars == 0 and not (tmp_path / "b").exists()


def test_export_shows_only_our_lines_and_a_moved_plan_still_exports(tiny_model_dir, synth_pages, tmp_path):
    """The acceptance run: `ocriaquant export` in a fresh process, as a user types it. stdout holds
    our one result line; stderr our notes and the log's name, nothing from loguru (llmcompressor),
    logging (transformers), warnings or tqdm; all of that is in OUT's folder/ocriaquant.log. The plan
    was written in another folder and moved with its model: its relative paths still find it."""
    from ocriaquant.artifacts import Plan, model_fingerprint, save_plan

    here = tmp_path / "cpu-box"
    shutil.copytree(tiny_model_dir, here / "model")
    (here / "out" / "search").mkdir(parents=True)
    plan = {"layers.0.gdn_in": "nvfp4", "layers.0.mlp_up": "nvfp4", "layers.3.attn_qkv": "fp8", "lm_head": "bf16"}
    save_plan(here / "out" / "search" / "plan.json",
              Plan(groups=plan, target="b200", model_dir=here / "model", calibration=here / "out" / "calib",
                   model_fingerprint=model_fingerprint(here / "model")))
    doc = json.loads((here / "out" / "search" / "plan.json").read_text())
    assert doc["model_dir"] == os.path.join("..", "..", "model")
    assert doc["calibration"]["path"] == os.path.join("..", "calib")
    there = tmp_path / "gpu-box"
    here.rename(there)
    work = tmp_path / "elsewhere"
    work.mkdir()

    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_COMPRESSOR_", "TRANSFORMERS_VERBOSITY"))}
    res = subprocess.run([sys.executable, "-m", "ocriaquant", "export", str(there / "out" / "search" / "plan.json"),
                          "--out", str(there / "out" / "checkpoint"), "--pages", str(synth_pages), "--max-pages", "1",
                          "--verify-pages", "0"], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"wrote {there / 'out' / 'checkpoint'}"
    log_path = there / "out" / LOG_NAME
    err = res.stderr.splitlines()
    assert err[-1] == f"the libraries' messages are in {log_path} (--verbose shows them here)"
    assert all(line.startswith("note: ") for line in err[:-1]), res.stderr
    log = log_path.read_text()
    assert " | WARNING - " in log           # loguru (llmcompressor)
    assert "UserWarning" in log              # warnings (transformers' save)
    assert "Loading weights" in log          # tqdm
    for pattern, why in EXPLAINED:           # each library warning we cannot fix: explained once, if it came
        assert res.stderr.count(why) == (pattern in log), pattern
    assert any(why in res.stderr for _, why in EXPLAINED)
    assert (there / "out" / "checkpoint" / "config.json").is_file()
