"""scripts/ab_step.py's settings: a skip: variant's stand-in runs the real launcher once per call
site, then hands back those outputs without launching, and undo puts the launcher back."""

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need a GPU or TRITON_INTERPRET=1")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_skip_setting_runs_each_call_site_once_then_launches_nothing(monkeypatch, load_script):
    from ocriaquant.runtime import kernels
    from ocriaquant.runtime.kernels import add_rmsnorm_ref

    ab = load_script("ab_step")
    real = kernels.add_rmsnorm
    launches = []

    def counting(*args, **kwargs):  # the real launcher, counted
        launches.append(args[2].data_ptr())
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "add_rmsnorm", counting)
    settings = [ab.parse_setting("skip:add_rmsnorm")]
    saved = ab.apply(settings)
    torch.manual_seed(0)
    x, h = torch.randn(1, 64, device=DEV).bfloat16(), torch.randn(1, 64, device=DEV).bfloat16()
    w1, w2 = (torch.randn(64, device=DEV) * 0.1).bfloat16(), (torch.randn(64, device=DEV) * 0.1).bfloat16()
    try:
        r, y = kernels.add_rmsnorm(x, h, w1, 1e-6)
        r_ref, y_ref = add_rmsnorm_ref(x, h, w1, 1e-6)
        assert torch.equal(r, r_ref) and float((y.float() - y_ref.float()).abs().max()) <= 0.02
        again = kernels.add_rmsnorm(x * 2, h, w1, 1e-6)  # same call site: the first outputs, no launch
        assert again[0] is r and again[1] is y and len(launches) == 1
        kernels.add_rmsnorm(x, h, w2, 1e-6)  # another call site (its own norm weight) runs once
        assert launches == [w1.data_ptr(), w2.data_ptr()]
    finally:
        ab.undo(saved)
    assert kernels.add_rmsnorm is counting


def test_skip_setting_names_what_it_can_skip(load_script):
    ab = load_script("ab_step")
    with pytest.raises(SystemExit, match="skip: takes one of add_rmsnorm"):
        ab.parse_setting("skip:gemv_fp8")


def test_code_setting_runs_the_launcher_of_another_copy(tmp_path, load_script):
    """code:<launcher>=<file>: the launcher comes from the file (here add_rmsnorm.py with a marker
    added), its relative imports resolved in the kernels package; undo puts the real one back."""
    from ocriaquant.runtime import kernels
    from ocriaquant.runtime.kernels import add_rmsnorm_ref

    ab = load_script("ab_step")
    src = Path(kernels.__file__).parent / "add_rmsnorm.py"
    copy = tmp_path / "add_rmsnorm_before.py"
    copy.write_text(src.read_text() + "\n\nadd_rmsnorm.from_copy = True\n")
    real = kernels.add_rmsnorm
    saved = ab.apply([ab.parse_setting(f"code:add_rmsnorm={copy}")])
    try:
        assert kernels.add_rmsnorm is not real and getattr(kernels.add_rmsnorm, "from_copy", False)
        torch.manual_seed(1)
        x, h = torch.randn(1, 64, device=DEV).bfloat16(), torch.randn(1, 64, device=DEV).bfloat16()
        w = (torch.randn(64, device=DEV) * 0.1).bfloat16()
        r, y = kernels.add_rmsnorm(x, h, w, 1e-6)
        r_ref, y_ref = add_rmsnorm_ref(x, h, w, 1e-6)
        assert torch.equal(r, r_ref) and float((y.float() - y_ref.float()).abs().max()) <= 0.02
    finally:
        ab.undo(saved)
    assert kernels.add_rmsnorm is real
    with pytest.raises(SystemExit, match="no such file"):
        ab.parse_setting(f"code:add_rmsnorm={tmp_path / 'missing.py'}")
    with pytest.raises(SystemExit, match="is not code:<launcher>=<file>"):
        ab.parse_setting(f"code:no_such_kernel={copy}")


def test_forget_captures_drops_every_cached_tile(monkeypatch, load_script):
    """Between variants ab_step drops the Linears' cached tiles, the FP8 tensor-core ones above batch 1
    too, so a variant's OCRIAQUANT_TILE_fp8_dot_* override reaches the GEMV; tile_names lists it."""
    import importlib

    from ocriaquant.quant import fp8
    from ocriaquant.runtime.kernels.gemv_dot import gemv_dot
    from ocriaquant.runtime.layers import QuantLinear

    ab = load_script("ab_step")
    gf = importlib.import_module("ocriaquant.runtime.kernels.gemv_fp8")  # the module, not the function
    seen = []
    monkeypatch.setattr(gf, "gemv_dot", lambda *a, **kw: seen.append(kw) or gemv_dot(*a, **kw))
    w_q, w_s = fp8.quantize_weight(torch.randn(64, 256, dtype=torch.bfloat16, device=DEV) / 16)
    lin = QuantLinear("fp8", w_q, w_s).to(DEV)
    lin.triton = True
    rt = torch.nn.Sequential(lin)
    rt._graphs, rt._last = {}, None
    x = torch.randn(4, 256, dtype=torch.bfloat16, device=DEV)
    lin(x)
    lin(torch.randn(1, 256, dtype=torch.bfloat16, device=DEV))
    assert ab.tile_names(rt) == {"OCRIAQUANT_TILE_fp8_dot_64x256", "OCRIAQUANT_TILE_fp8_64x256"}
    monkeypatch.setenv("OCRIAQUANT_TILE_fp8_dot_64x256", "32,64,4,2,6")
    lin(x)  # the tile looked up before the override is still cached
    ab.forget_captures(rt, [])
    assert ab.tile_names(rt) == set()
    lin(x)
    assert seen[1]["block_n"] != 32 and (seen[2]["block_n"], seen[2]["split_k"], seen[2]["num_stages"]) == (32, 2, 6)
