import json

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
