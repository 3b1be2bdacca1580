"""benchmarks/ab_step.py's settings: a skip: variant's stand-in runs the real launcher once per call
site, then hands back those outputs without launching; code: runs the launcher of another copy of
its module; tiles: runs the GEMVs at another tile table; undo puts everything back."""

import importlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need a GPU or TRITON_INTERPRET=1")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _add_rmsnorm_module():
    """ocriaquant.runtime.kernels.add_rmsnorm, the module (where the layers import the launcher from)."""
    return importlib.import_module("ocriaquant.runtime.kernels.add_rmsnorm")


def test_skip_setting_runs_each_call_site_once_then_launches_nothing(monkeypatch, load_benchmark):
    from ocriaquant.runtime.kernels.reference import add_rmsnorm_ref

    ab = load_benchmark("ab_step")
    mod = _add_rmsnorm_module()
    real = mod.add_rmsnorm
    launches = []

    def counting(*args, **kwargs):  # the real launcher, counted
        launches.append(args[2].data_ptr())
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "add_rmsnorm", counting)
    settings = [ab.parse_setting("skip:add_rmsnorm")]
    saved = ab.apply(settings)
    torch.manual_seed(0)
    x, h = torch.randn(1, 64, device=DEV).bfloat16(), torch.randn(1, 64, device=DEV).bfloat16()
    w1, w2 = (torch.randn(64, device=DEV) * 0.1).bfloat16(), (torch.randn(64, device=DEV) * 0.1).bfloat16()
    try:
        r, y = mod.add_rmsnorm(x, h, w1, 1e-6)
        r_ref, y_ref = add_rmsnorm_ref(x, h, w1, 1e-6)
        assert torch.equal(r, r_ref) and float((y.float() - y_ref.float()).abs().max()) <= 0.02
        again = mod.add_rmsnorm(x * 2, h, w1, 1e-6)  # same call site: the first outputs, no launch
        assert again[0] is r and again[1] is y and len(launches) == 1
        mod.add_rmsnorm(x, h, w2, 1e-6)  # another call site (its own norm weight) runs once
        assert launches == [w1.data_ptr(), w2.data_ptr()]
    finally:
        ab.undo(saved)
    assert mod.add_rmsnorm is counting


def test_skip_setting_names_what_it_can_skip(load_benchmark):
    ab = load_benchmark("ab_step")
    with pytest.raises(SystemExit, match="skip: takes one of add_rmsnorm"):
        ab.parse_setting("skip:gemv_fp8")


def test_code_setting_runs_the_launcher_of_another_copy(tmp_path, load_benchmark):
    """code:<launcher>=<file>: the launcher comes from the file (here add_rmsnorm.py with a marker
    added), its relative imports resolved in the kernels package; undo puts the real one back."""
    from ocriaquant.runtime.kernels.reference import add_rmsnorm_ref

    ab = load_benchmark("ab_step")
    mod = _add_rmsnorm_module()
    copy = tmp_path / "add_rmsnorm_before.py"
    copy.write_text(Path(mod.__file__).read_text() + "\n\nadd_rmsnorm.from_copy = True\n")
    real = mod.add_rmsnorm
    saved = ab.apply([ab.parse_setting(f"code:add_rmsnorm={copy}")])
    try:
        assert mod.add_rmsnorm is not real and getattr(mod.add_rmsnorm, "from_copy", False)
        torch.manual_seed(1)
        x, h = torch.randn(1, 64, device=DEV).bfloat16(), torch.randn(1, 64, device=DEV).bfloat16()
        w = (torch.randn(64, device=DEV) * 0.1).bfloat16()
        r, y = mod.add_rmsnorm(x, h, w, 1e-6)
        r_ref, y_ref = add_rmsnorm_ref(x, h, w, 1e-6)
        assert torch.equal(r, r_ref) and float((y.float() - y_ref.float()).abs().max()) <= 0.02
    finally:
        ab.undo(saved)
    assert mod.add_rmsnorm is real
    with pytest.raises(SystemExit, match="no such file"):
        ab.parse_setting(f"code:add_rmsnorm={tmp_path / 'missing.py'}")
    with pytest.raises(SystemExit, match="is not code:<launcher>=<file>"):
        ab.parse_setting(f"code:no_such_kernel={copy}")


def test_tiles_setting_runs_the_gemvs_at_another_table(tmp_path, monkeypatch, load_benchmark):
    """tiles:<file>: the variant's table reaches the GEMV once the captures are dropped (the layers read
    the runner's shared kernel settings at every launch), tile_changes names the GEMVs whose tile it
    changes at the batch timed, and undo puts the runner's own table back."""
    from ocriaquant.quant import fp8
    from ocriaquant.runtime.config import Kernels
    from ocriaquant.runtime.kernels.gemv_dot import gemv_dot
    from ocriaquant.runtime.layers import QuantLinear
    from ocriaquant.runtime.tiles import TileTable

    ab = load_benchmark("ab_step")
    m1 = {"kind": "fp8", "n": 64, "k": 256, "block_n": 16, "block_k": 256}
    dot = {"kind": "fp8", "n": 64, "k": 256, "m": [2, 8], "block_n": 64, "block_k": 128, "num_warps": 4,
           "split_k": 1, "num_stages": 2}
    (tmp_path / "base.json").write_text(json.dumps({"tiles": [m1, dot]}))
    (tmp_path / "variant.json").write_text(json.dumps({"tiles": [m1, dict(dot, block_n=32, block_k=64, split_k=2,
                                                                           num_stages=6)]}))
    gf = importlib.import_module("ocriaquant.runtime.kernels.gemv_fp8")  # the module, not the function
    seen = []
    monkeypatch.setattr(gf, "gemv_dot", lambda *a, **kw: seen.append(kw) or gemv_dot(*a, **kw))
    w_q, w_s = fp8.quantize_weight(torch.randn(64, 256, dtype=torch.bfloat16, device=DEV) / 16)
    kernels = Kernels(pdl=False, tiles=TileTable.load(tmp_path / "base.json"))
    lin = QuantLinear("fp8", w_q, w_s, kernels=kernels).to(DEV)
    runner = SimpleNamespace(kernels=kernels, model=SimpleNamespace(tile_keys=lambda: set(lin.tile_keys())),
                             _graphs={4: "a graph"}, _last=(4, None))
    x = torch.randn(4, 256, dtype=torch.bfloat16, device=DEV)

    setting = ab.parse_setting(f"tiles:{tmp_path / 'variant.json'}")
    assert ab.tile_changes(runner, setting[3], 1) == []  # batch 1: the same tile in both tables
    assert ab.tile_changes(runner, setting[3], 3) == [  # batch 3 runs as its graph's bucket, 4
        "fp8 64x256: {'block_n': 64, 'block_k': 128, 'num_warps': 4, 'split_k': 1, 'num_stages': 2} -> "
        "{'block_n': 32, 'block_k': 64, 'num_warps': 4, 'split_k': 2, 'num_stages': 6}"]
    lin(x)
    saved = ab.apply([setting, ab.parse_setting("pdl:1")], runner)
    retired = []
    try:
        assert runner.kernels.tiles is setting[3] and lin.kernels.pdl is True
        ab.forget_captures(runner, retired)
        assert runner._graphs == {} and runner._last is None and retired == ["a graph"]
        out = lin(x)
    finally:
        ab.undo(saved)
    assert runner.kernels.tiles.source == str(tmp_path / "base.json") and lin.kernels.pdl is False
    lin(x)
    assert [(s["block_n"], s["split_k"], s["num_stages"]) for s in seen] == [(64, 1, 2), (32, 2, 6), (64, 1, 2)]
    ref = x.float() @ fp8.dequantize(w_q, w_s).float().T
    assert float((out.float() - ref).norm() / ref.norm()) <= 0.05
    with pytest.raises(SystemExit, match="no such tile table"):
        ab.parse_setting(f"tiles:{tmp_path / 'missing.json'}")
    with pytest.raises(SystemExit, match="needs a runtime on the triton backend"):
        ab.apply([setting])
    with pytest.raises(SystemExit, match="tiles:<file> replaces OCRIAQUANT_TILE_"):
        ab.parse_setting("env:OCRIAQUANT_TILE_fp8_64x256=32,64,4")
