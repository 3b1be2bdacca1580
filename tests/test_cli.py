import json
import time

from typer.testing import CliRunner

from ocriaquant.cli import app

runner = CliRunner()


def test_info_default_shows_bundled_model_and_pages():
    res = runner.invoke(app, ["info"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "6 GDN, 2 attention" in res.output
    assert "128 pages (128 with ground truth)" in res.output
    assert "all-NVFP4" in res.output


def test_info_4b_shape_json():
    res = runner.invoke(app, ["info", "--shape", "qwen3.5-4b", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["gdn_layers"] == 24 and data["attention_layers"] == 8
    assert abs(data["decoder_linear_params"] - 3.57e9) / 3.57e9 < 0.01
    b = data["decode_step_bytes"]
    assert b["bf16"] > b["fp8"] > b["nvfp4"]


def test_info_errors_are_one_line_with_exit_2(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    res = runner.invoke(app, ["info", str(tmp_path)])
    assert res.exit_code == 2
    assert "mistral" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["info", "--shape", "gpt-5"])
    assert res.exit_code == 2 and "unknown shape" in res.output


def test_help_teaches():
    res = runner.invoke(app, ["info", "--help"], terminal_width=200)
    assert res.exit_code == 0 and "meta device" in res.output and "Examples" in res.output


def test_quantize_refuses_an_existing_checkpoint_before_any_work(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "keep.txt").write_text("mine")
    res = runner.invoke(app, ["quantize", "--out", str(tmp_path)])
    assert res.exit_code == 2
    assert "already exists" in res.output and "--force" in res.output
    assert not (tmp_path / "calib").exists()  # failed before calibrating
    assert (tmp_path / "checkpoint" / "keep.txt").read_text() == "mine"
    res = runner.invoke(app, ["quantize", "--help"], terminal_width=200)
    assert res.exit_code == 0 and "--max-ned-increase" in res.output and "calib/" in res.output


def test_bench_cpu_smoke_reports_every_row_and_counts_the_weights(tmp_path):
    """`ocriaquant bench` on the bundled model (torch backend, CPU): one decode row per batch,
    one pages row per concurrency, transformers beside it, and the roofline's weight bytes
    equal to the decoder Linears' + head's bytes read back from the safetensors."""
    from safetensors import safe_open

    from ocriaquant.model.load import resolve_model_dir

    out = tmp_path / "bench.json"
    res = runner.invoke(app, ["bench", "--device", "cpu", "--backend", "torch", "--batches", "1,2", "--steps", "2",
                              "--concurrency", "2", "--pages", "3", "--out-tokens", "3", "--context", "8",
                              "--baseline-tokens", "2", "--megapixels", "0.2", "--out", str(out)],
                        terminal_width=200)
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert [r["batch"] for r in rep["decode"]] == [1, 2]
    assert all(r["tok_per_s"] > 0 and r["transformers_tok_per_s"] > 0 for r in rep["decode"])
    (pages,) = rep["pages"]
    assert pages["pages"] == 3 and pages["concurrency"] == 2 and pages["p50_s"] <= pages["p90_s"]
    assert pages["tok_per_s"] > 0
    tensors = {}
    for f in resolve_model_dir(None).glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            tensors.update({k: h.get_tensor(k).nbytes for k in h.keys()})
    want = sum(n for k, n in tensors.items()
               if k.startswith("model.language_model.layers.") and "proj" in k.rsplit(".", 2)[-2])
    # the head is lm_head, or the embedding when tied
    want += tensors.get("lm_head.weight", tensors["model.language_model.embed_tokens.weight"])
    assert rep["decode"][0]["weights_bytes"] == want


def test_bench_pages_exclude_a_first_call_cost(monkeypatch):
    """A one-off cost on the engine's first page (kernels compiling, graphs capturing: ~10 s on
    a GPU) is paid in bench's untimed warm-up, not by the first timed page: every page's latency
    stays below it."""
    from ocriaquant import bench
    from ocriaquant.runtime.model_runner import ModelRunner

    first_cost = 4.0
    real = ModelRunner.prefill_chunks
    calls = []

    def prefill_chunks(self, parts, **kw):
        calls.append(len(parts))
        if len(calls) == 1:
            time.sleep(first_cost)
        return real(self, parts, **kw)

    monkeypatch.setattr(ModelRunner, "prefill_chunks", prefill_chunks)
    rep = bench.run(None, bench.BenchOptions(device="cpu", backend="torch", batches=(1,), context=8, steps=1,
                                             concurrency=(1,), pages=3, megapixels=0.2, out_tokens=2, baseline=False,
                                             cuda_graphs=False), log=lambda _: None)
    (pages,) = rep["pages"]
    assert calls == [1] * 5  # the warm-up's page in two passes (a continuing chunk compiles too), 3 timed
    assert pages["pages"] == 3 and pages["p90_s"] < first_cost <= rep["pages_warmup_s"]


def test_bench_cut_short_keeps_what_it_measured(monkeypatch, tmp_path):
    """A bench stopped midway (here a page level fails; a call killed at its time limit alike) leaves the figures
    it measured in --out, marked partial, the SLO search's levels so far included; a run that ends leaves the
    whole report, unmarked."""
    from ocriaquant import bench
    from ocriaquant.runtime import measure

    real, calls = bench.page_speed, {"n": 0, "cut_at": 2}

    def page_speed(*a, **kw):
        calls["n"] += 1
        if calls["n"] == calls["cut_at"]:
            raise RuntimeError("cut short")
        return real(*a, **kw)

    monkeypatch.setattr(bench, "page_speed", page_speed)
    monkeypatch.setattr(measure, "page_speed", page_speed)  # the SLO search's
    out = tmp_path / "bench.json"
    common = ["bench", "--device", "cpu", "--backend", "torch", "--batches", "1,2", "--steps", "1", "--pages", "2",
              "--out-tokens", "2", "--context", "8", "--no-baseline", "--megapixels", "0.2", "--out", str(out)]
    assert runner.invoke(app, [*common, "--concurrency", "1,2"]).exit_code != 0
    rep = json.loads(out.read_text())
    assert rep["partial"] and [r["batch"] for r in rep["decode"]] == [1, 2]
    assert [r["concurrency"] for r in rep["pages"]] == [1] and "slo" not in rep

    calls.update(n=0, cut_at=2)  # an SLO no level holds: concurrency 2, then 1, which fails
    assert runner.invoke(app, [*common, "--concurrency", "", "--slo-p90", "1e-6"]).exit_code != 0
    rep = json.loads(out.read_text())
    assert rep["partial"] and rep["slo"]["searching"] and [r["concurrency"] for r in rep["slo"]["levels"]] == [2]

    calls.update(n=0, cut_at=None)
    res = runner.invoke(app, [*common, "--concurrency", "1,2"])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert "partial" not in rep and [r["concurrency"] for r in rep["pages"]] == [1, 2]


def test_bench_refuses_bad_input_with_one_line():
    res = runner.invoke(app, ["bench", "--shape", "gpt-5", "--device", "cpu", "--backend", "torch"])
    assert res.exit_code == 2 and "unknown shape 'gpt-5'" in res.output
    res = runner.invoke(app, ["bench", "--batches", "1,x", "--device", "cpu", "--backend", "torch"])
    assert res.exit_code == 2 and "comma-separated integers" in res.output
    res = runner.invoke(app, ["bench", "--baseline-tokens", "0", "--device", "cpu", "--backend", "torch"])
    assert res.exit_code == 2 and "at least 1 decode step" in res.output


def test_transformers_speed_times_decode_steps_not_a_difference_of_runs():
    """The baseline's seconds per step is what one decode step takes, however long the prefills
    are: here each prefill sleeps longer than the last, so the old difference of a long run and a
    short run (each best of three) came out negative, while every step stamped costs >= 50 ms."""
    from ocriaquant.bench import transformers_speed
    from ocriaquant.model.load import load_model

    hf = load_model(None, "fp32")[0]
    real, prefills = hf.forward, []

    def forward(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:  # a prefill, longer each time
            prefills.append(1)
            time.sleep(0.1 * len(prefills))
        else:
            time.sleep(0.05)
        return real(*args, **kwargs)

    hf.forward = forward
    sec = transformers_speed(hf, batch=1, context=6, new_tokens=2, vocab=hf.config.text_config.vocab_size)
    assert len(prefills) == 4  # the warm-up and three timed runs
    assert 0.05 <= sec < 0.15  # a prefill here sleeps >= 0.2 s


def test_named_plans_quantize_every_decoder_linear_once_in_their_formats():
    """bench's named plans list the same decoder Linears — each once, every layer's MLP and mixer
    projections — and give them the plan's formats: mixed NVFP4 MLPs and FP8 mixers, fp8 / nvfp4
    everything in that format."""
    from ocriaquant.bench import PLANS, plan_units
    from ocriaquant.model.configs import SHAPES

    config = SHAPES["qwen3.5-4b"]()
    layers = config.text_config.layer_types
    formats = {}
    for plan in ("mixed", "fp8", "nvfp4"):
        assert plan in PLANS
        names = [(n, fmt) for unit, fmt in plan_units(config, plan) for n in unit]
        assert len({n for n, _ in names}) == len(names)
        formats[plan] = dict(names)
    assert formats["mixed"].keys() == formats["fp8"].keys() == formats["nvfp4"].keys()
    gdn, attn = layers.count("linear_attention"), layers.count("full_attention")
    assert gdn + attn == len(layers) and gdn and attn
    assert len(formats["mixed"]) == len(layers) * 3 + gdn * 5 + attn * 4
    for n, fmt in formats["mixed"].items():
        assert fmt == ("nvfp4" if ".mlp." in n else "fp8"), n
    assert set(formats["fp8"].values()) == {"fp8"} and set(formats["nvfp4"].values()) == {"nvfp4"}


def test_decode_speed_times_with_the_collector_off_and_gives_it_back():
    """bench.decode_speed collects garbage before its timed steps and keeps Python's collector off
    during them (as timeit does), then restores the collector's state, on or off, also on error."""
    import gc

    import pytest
    import torch

    from ocriaquant.bench import decode_speed

    class Pending:
        def get(self):
            return None

    class FakeRuntime:
        device = torch.device("cpu")

        def __init__(self, fail_at=None):
            self.seen, self.fail_at = [], fail_at

        def greedy_step(self, tokens, slots, lengths, deltas):
            self.seen.append(gc.isenabled())
            if self.fail_at is not None and len(self.seen) == self.fail_at:
                raise RuntimeError("step failed")
            return Pending()

    was = gc.isenabled()
    try:
        gc.enable()
        rt = FakeRuntime()
        assert decode_speed(rt, 1, 8, 5, 100) > 0
        # the first call and three warm-up steps run with the collector on, the five timed ones without
        assert rt.seen == [True] * 4 + [False] * 5 and gc.isenabled()
        gc.disable()
        decode_speed(FakeRuntime(), 1, 8, 2, 100)
        assert not gc.isenabled()
        gc.enable()
        with pytest.raises(RuntimeError, match="step failed"):
            decode_speed(FakeRuntime(fail_at=6), 1, 8, 5, 100)
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def _early_breaks(text: str, width: int) -> list[str]:
    """Line pairs of a help's prose (before its first panel; code blocks, indented by two or more,
    left out) where a line ends although the next word would have fitted: a break mid-sentence."""
    lines = text.split("╭")[0].splitlines()
    return [f"{a.strip()!r} / {b.strip()!r}" for a, b in zip(lines, lines[1:])
            if a.strip() and b.strip() and not a.startswith("  ") and not b.startswith("  ") and "Usage:" not in a
            and len(a.rstrip()) + 1 + len(b.split()[0]) < width]


def test_every_help_reflows_at_80_columns_and_offers_verbose():
    """`ocriaquant VERB --help` at 80 columns: paragraphs break only where the next word does not
    fit (the docstrings' own line breaks used to show: 'CER, exact' / 'match'), examples stay whole
    lines, and every verb has --verbose."""
    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    assert len(names) == 8
    for name in [None] + names:
        res = runner.invoke(app, [name, "--help"] if name else ["--help"], env={"COLUMNS": "80"})
        assert res.exit_code == 0, res.output
        assert max(len(line) for line in res.output.splitlines()) <= 80
        assert not _early_breaks(res.output, 80), (name, _early_breaks(res.output, 80))
        if name:
            assert "--verbose" in res.output, name
    res = runner.invoke(app, ["quantize", "--help"], env={"COLUMNS": "80"})
    example = "ocriaquant quantize ~/models/OCRia-1 --pages ~/my-pages --target b200"
    assert example in [line.strip() for line in res.output.splitlines()]


def test_a_config_without_weights_is_described_with_a_warning_and_refused_where_weights_are_needed(
        tiny_model_dir, tmp_path):
    import shutil

    cfg = tmp_path / "config-only"
    cfg.mkdir()
    shutil.copy(tiny_model_dir / "config.json", cfg)
    res = runner.invoke(app, ["info", str(cfg)], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "its weights are missing" in res.output
    assert f"warning: {cfg}: no weights (config.json, but no *.safetensors files)" in res.output
    res = runner.invoke(app, ["info", str(cfg), "--json"])
    assert "no weights" in json.loads(res.stdout)["weights_problem"]
    assert json.loads(runner.invoke(app, ["info", "--json"]).stdout)["weights_problem"] is None
    for verb in (["calibrate", str(cfg), "--out", str(tmp_path / "calib")], ["eval", str(cfg)],
                 ["parse", str(cfg), "--out", str(tmp_path / "parsed")], ["quantize", str(cfg), "--out", str(tmp_path)],
                 ["bench", str(cfg), "--device", "cpu", "--backend", "torch"]):
        res = runner.invoke(app, verb)
        assert res.exit_code == 2, (verb, res.output)
        assert f"error: {cfg}: no weights" in res.output and "Traceback" not in res.output, verb
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config-only"]  # refused before any work


def test_a_folder_of_pages_given_as_the_model_gets_the_right_command(tiny_model_dir, synth_pages):
    """`ocriaquant parse my_pages/`, as people type it: the folder is recognised as pages, and the
    command they meant is printed; likewise for verbs whose pages go in --pages."""
    res = runner.invoke(app, ["parse", str(synth_pages)])
    assert res.exit_code == 2
    assert f"error: {synth_pages}: a folder of 6 pages, not a model directory" in res.output
    assert f"    ocriaquant parse CHECKPOINT {synth_pages}\n" in res.output
    res = runner.invoke(app, ["parse", str(synth_pages), str(tiny_model_dir)])
    assert res.exit_code == 2 and f"    ocriaquant parse {tiny_model_dir} {synth_pages}\n" in res.output
    for verb in ("info", "calibrate", "eval", "quantize"):
        res = runner.invoke(app, [verb, str(synth_pages)])
        assert res.exit_code == 2, verb
        assert f"    ocriaquant {verb} --pages {synth_pages}\n" in res.output, res.output


def test_a_plan_names_its_model_relative_to_itself_and_export_refuses_a_missing_or_other_model(
        tiny_model_dir, tmp_path):
    """plan.json keeps paths relative to its own folder (the bundled model by name), so it moves
    with them; moved alone, export names the missing model and asks for --model, whose fingerprint
    must match, before any work."""
    from ocriaquant.artifacts import Plan, load_plan, model_fingerprint, save_plan
    from ocriaquant.model import DEFAULT_MODEL

    plan = Plan(groups={"layers.0.mlp_up": "fp8"}, model_dir=tiny_model_dir, calibration=tmp_path / "calib",
                model_fingerprint=model_fingerprint(tiny_model_dir))
    save_plan(tmp_path / "plan.json", plan)
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert not doc["model_dir"].startswith("/") and doc["calibration"]["path"] == "calib"
    assert load_plan(tmp_path / "plan.json") == plan
    save_plan(tmp_path / "bundled.json", Plan(groups={}, model_dir=DEFAULT_MODEL))
    assert json.loads((tmp_path / "bundled.json").read_text())["model"] == "bundled"
    assert load_plan(tmp_path / "bundled.json").model_dir == DEFAULT_MODEL

    alone = tmp_path / "elsewhere" / "deeper"
    alone.mkdir(parents=True)
    (alone / "plan.json").write_text((tmp_path / "plan.json").read_text())  # its relative model path is gone
    res = runner.invoke(app, ["export", str(alone / "plan.json"), "--out", str(tmp_path / "ckpt")])
    assert res.exit_code == 2
    assert "is not here; pass --model DIR" in res.output and plan.model_fingerprint in res.output
    res = runner.invoke(app, ["export", str(alone / "plan.json"), "--out", str(tmp_path / "ckpt"),
                              "--model", str(DEFAULT_MODEL)])
    assert res.exit_code == 2 and "does not match the model the plan was calibrated on" in res.output
    assert not (tmp_path / "ckpt").exists()
