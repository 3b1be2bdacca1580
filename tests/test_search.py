import itertools
import json
import random
from dataclasses import replace

import pytest

from ocriaquant.artifacts import load_plan
from ocriaquant.errors import OcriaError
from ocriaquant.search import BANDWIDTH, CostModel, Policy, SearchOptions, pareto_frontier, run_search


def _brute_force(options):
    names = list(options)
    pts = []
    for combo in itertools.product(*(options[g] for g in names)):
        pts.append((sum(o[1] for o in combo), sum(o[2] for o in combo)))
    # non-dominated: no other point at most as slow with strictly less damage, or faster with no more damage
    front = {(t, d) for t, d in pts
             if not any((t2 <= t and d2 < d) or (t2 < t and d2 <= d) for t2, d2 in pts)}
    return sorted(front)


@pytest.mark.parametrize("seed", range(30))
def test_frontier_is_exact_on_small_instances(seed):
    rng = random.Random(seed)
    options = {}
    for g in range(rng.randint(1, 7)):
        k = rng.randint(1, 3)
        # integer-valued costs make ties (equal times, equal damages) common
        options[f"g{g}"] = [(f"f{j}", float(rng.randint(1, 6)), float(rng.randint(0, 6))) for j in range(k)]
    front = pareto_frontier(options)
    got = sorted((p.time, p.damage) for p in front)
    assert got == _brute_force(options)
    for p in front:  # every plan adds up to its point
        assert p.time == sum(dict((o[0], o[1]) for o in options[g])[f] for g, f in p.plan.items())
        assert p.damage == sum(dict((o[0], o[2]) for o in options[g])[f] for g, f in p.plan.items())


GROUPS = ["vision", "layers.0.gdn_in", "layers.0.gdn_ab", "layers.0.mlp_up", "layers.1.attn_qkv", "lm_head"]


def test_policy_pins_forbids_and_names_unknown_groups(tmp_path):
    pol = tmp_path / "p.yaml"
    pol.write_text("formats: [bf16, fp8, nvfp4]\npin:\n  'layers.0.*': fp8\nforbid:\n  lm_head: [nvfp4]\n")
    allowed = Policy.load(pol).allowed(GROUPS, {"vision", "layers.0.gdn_ab"})
    assert allowed["layers.0.gdn_in"] == ["fp8"] and allowed["layers.0.mlp_up"] == ["fp8"]
    assert allowed["layers.0.gdn_ab"] == ["bf16"] and allowed["vision"] == ["bf16"]
    assert allowed["lm_head"] == ["bf16", "fp8"] and allowed["layers.1.attn_qkv"] == ["bf16", "fp8", "nvfp4"]
    options = {g: [(f, {"bf16": 3.0, "fp8": 2.0, "nvfp4": 1.0}[f], {"bf16": 0.0, "fp8": 1.0, "nvfp4": 5.0}[f])
                   for f in fmts] for g, fmts in allowed.items()}
    for p in pareto_frontier(options):
        assert p.plan["layers.0.gdn_in"] == "fp8" and p.plan["layers.0.gdn_ab"] == "bf16"
        assert p.plan["lm_head"] != "nvfp4"
    pol.write_text("pin:\n  'layers.9.mlp_up': fp8\n")
    with pytest.raises(OcriaError, match="layers.9.mlp_up.*matches no layer group"):
        Policy.load(pol).allowed(GROUPS, set())
    pol.write_text("formats: [bf16, int4]\n")
    with pytest.raises(OcriaError, match="unknown format 'int4'"):
        Policy.load(pol)


def test_default_policy_pins_vision_and_gdn_ab():
    allowed = Policy.load().allowed(GROUPS, set())
    assert allowed["vision"] == ["bf16"] and allowed["layers.0.gdn_ab"] == ["bf16"]
    assert allowed["layers.0.gdn_in"] == ["bf16", "fp8", "nvfp4"]


def test_cost_model_analytical_and_table(tmp_path):
    cm = CostModel.load("h200", batch=1)
    t = cm.member_time(2560, 9216, "bf16")
    assert t == pytest.approx((2560 * 9216 * 2 + (2560 + 9216) * 2) / BANDWIDTH["h200"])
    assert cm.member_time(2560, 9216, "nvfp4") < cm.member_time(2560, 9216, "fp8") < t
    assert CostModel.load("b200").member_time(2560, 9216, "bf16") < t
    table = tmp_path / "lat.json"
    table.write_text(json.dumps({"gpu": "NVIDIA H200", "entries": [
        {"n": 2560, "k": 9216, "format": "fp8", "batch": 1, "us": 9.5}]}))
    cm = CostModel.load("h200", 1, table)
    assert cm.member_time(2560, 9216, "fp8") == pytest.approx(9.5e-6)
    assert cm.member_time(2560, 9216, "nvfp4") == CostModel.load("h200").member_time(2560, 9216, "nvfp4")
    table.write_text("{}")
    with pytest.raises(OcriaError, match="not a latency table"):
        CostModel.load("h200", 1, table)
    with pytest.raises(OcriaError, match="unknown target"):
        CostModel.load("a100")


def test_search_end_to_end_is_deterministic(tiny_model_dir, synth_pages, tmp_path):
    from ocriaquant.calibrate import CalibrateOptions, calibrate

    calibrate(tiny_model_dir, synth_pages, tmp_path / "calib", CalibrateOptions(max_pages=None, batch_size=3, split="all"))
    opts = SearchOptions(target="h200", eval_pages=3, candidates=2, max_new_tokens=12, max_ned_increase=0.5)
    rep = run_search(tmp_path / "calib", synth_pages, tmp_path / "s1", opts)
    run_search(tmp_path / "calib", synth_pages, tmp_path / "s2", opts)
    for f in ("plan.json", "report.json", "report.md", "pareto.png"):
        assert (tmp_path / "s1" / f).exists()
    plan = json.loads((tmp_path / "s1" / "plan.json").read_text())
    assert plan == json.loads((tmp_path / "s2" / "plan.json").read_text())
    assert plan["target"] == "h200" and plan["groups"]["vision"] == "bf16"
    assert all(f == "bf16" for g, f in plan["groups"].items() if g.endswith("gdn_ab"))
    assert load_plan(tmp_path / "s1" / "plan.json").to_json() == plan  # what export reads is what search wrote
    labels = [c["label"] for c in rep["candidates"]]
    assert labels[:4] == ["BF16", "all-FP8 (W8A8, both targets)", "all-NVFP4 (h200: W4A16)",
                          "all-NVFP4 (b200: W4A4)"]
    assert rep["frontier_points"] >= 5 and len(rep["candidates"]) >= 5
    md = (tmp_path / "s1" / "report.md").read_text()
    assert "Pareto frontier" in md and "Chosen plan per layer group" in md

    # the peers (default: all four) are evaluated beside ours and never chosen
    peers = {p["name"]: p for p in rep["peers"]}
    assert set(peers) == {"llmcompressor-nvfp4", "nvidia-nvfp4-mlp", "qwen-fp8", "community-last-fp8"}
    assert [c["label"] for c in rep["candidates"] if c["role"] == "peer"] == [p["label"] for p in rep["peers"]]
    assert not rep["chosen"].startswith("peer ")
    for p in rep["peers"]:
        assert p["frontier"]["position"] in ("dominated", "on", "beyond") and len(p["ned_increase"]) == 3
        assert p["chosen_dominates"] == (p["name"] in rep["peers_dominated_by_chosen"])
    assert any("mtp" in u for u in peers["llmcompressor-nvfp4"]["unmatched_rules"])
    assert "## Published recipes beside ours" in md and "How each recipe maps" in md
    assert f"**{rep['chosen']} dominates {len(rep['peers_dominated_by_chosen'])} of 4 published recipes" in md \
        or rep["chosen"] == "BF16"
    # the report agrees with itself (#58): counts of an evaluated frontier point are the same in both tables,
    # and the verdict does not repeat the chosen label
    for c in rep["candidates"]:
        if c["role"] == "ours":
            row = next(p for p in rep["frontier"] if c["label"] in p.get("evaluated_as", []))
            assert row["formats"] == c["formats"] and row["predicted_ms"] == pytest.approx(c["predicted_ms"])
    assert not rep["verdict"].startswith(rep["chosen"])
    assert f"**Chosen: {rep['chosen']}** — {rep['verdict']}" in md


def test_search_without_peers_and_with_an_unknown_peer(tiny_model_dir, synth_pages, tmp_path):
    from ocriaquant.calibrate import CalibrateOptions, calibrate

    calibrate(tiny_model_dir, synth_pages, tmp_path / "calib", CalibrateOptions(max_pages=None, batch_size=3, split="all"))
    opts = SearchOptions(eval_pages=2, candidates=1, max_new_tokens=6, max_ned_increase=0.5, peers="none")
    rep = run_search(tmp_path / "calib", synth_pages, tmp_path / "s", opts)
    assert rep["peers"] == [] and all(c["role"] != "peer" for c in rep["candidates"])
    assert "None evaluated (`--peers none`)" in (tmp_path / "s" / "report.md").read_text()
    with pytest.raises(OcriaError, match="no peer recipe 'gptq'"):
        run_search(tmp_path / "calib", synth_pages, tmp_path / "s2", replace(opts, peers="qwen-fp8,gptq"))
    assert not (tmp_path / "s2").exists()


def test_search_needs_a_calibration_and_does_not_make_one(tmp_path):
    """Search reads calibrate's artifact; making it is calibrate's job (the CLI runs it first)."""
    with pytest.raises(OcriaError, match="run `ocriaquant calibrate` first"):
        run_search(tmp_path / "none", out=tmp_path / "s")
    assert not (tmp_path / "none").exists() and not (tmp_path / "s").exists()
