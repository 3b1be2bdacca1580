"""Published recipes as data (ocriaquant/recipes/peers/*.yaml): loaded, validated, mapped onto layer groups."""

import pytest

from ocriaquant import peers
from ocriaquant.artifacts import check_plan, load_plan, model_fingerprint
from ocriaquant.errors import OcriaError
from ocriaquant.model import discover_groups, meta_model, tiny_config


@pytest.fixture(scope="module")
def tiny_groups():
    """A Qwen3.5 tiny model's groups: layers 0-2 GDN, layer 3 full attention, 4 MLPs."""
    return discover_groups(meta_model(tiny_config()))


def _by_kind(plan: dict[str, str], groups) -> dict[str, set[tuple[int | None, str]]]:
    out: dict[str, set] = {}
    for g in groups:
        out.setdefault(g.kind, set()).add((g.layer, plan[g.name]))
    return out


def _formats(plan, groups, kind) -> set[str]:
    return {f for _, f in _by_kind(plan, groups)[kind]}


def test_bundled_recipes_are_the_four_published_ones():
    assert peers.available() == ["community-last-fp8", "llmcompressor-nvfp4", "nvidia-nvfp4-mlp", "qwen-fp8"]
    for r in peers.select("all"):
        assert r.source and r.title and r.rules


def test_llmcompressor_nvfp4_maps_as_documented(tiny_groups):
    """NVFP4 everywhere except linear_attn (all GDN groups), lm_head and the vision tower."""
    m = peers.load_recipe("llmcompressor-nvfp4").map(tiny_groups)
    for kind in ("gdn_in", "gdn_ab", "gdn_out", "lm_head", "vision"):
        assert _formats(m.plan, tiny_groups, kind) == {"bf16"}, kind
    for kind in ("attn_qkv", "attn_o", "mlp_up", "mlp_down"):
        assert _formats(m.plan, tiny_groups, kind) == {"nvfp4"}, kind
    # its MTP rule matches no layer group: reported, not ignored
    assert len(m.unmatched) == 1 and "mtp -> bf16" in m.unmatched[0] and "carries it over" in m.unmatched[0]


def test_nvidia_nvfp4_is_mlps_only(tiny_groups):
    m = peers.load_recipe("nvidia-nvfp4-mlp").map(tiny_groups)
    for g in tiny_groups:
        assert m.plan[g.name] == ("nvfp4" if g.kind in ("mlp_up", "mlp_down") else "bf16"), g.name
    assert any("mtp" in u for u in m.unmatched)


def test_qwen_fp8_is_fp8_but_gdn_ab_lm_head_vision(tiny_groups):
    m = peers.load_recipe("qwen-fp8").map(tiny_groups)
    for g in tiny_groups:
        assert m.plan[g.name] == ("bf16" if g.kind in ("gdn_ab", "lm_head", "vision") else "fp8"), g.name
    assert m.unmatched == []


def test_community_layout_last_quarter_mlps_fp8(tiny_groups):
    """4 layers: the last 25% is layer 3, whose MLP is FP8; MLPs 0-2 NVFP4; mixers FP8."""
    m = peers.load_recipe("community-last-fp8").map(tiny_groups)
    mlp = _by_kind(m.plan, tiny_groups)["mlp_up"] | _by_kind(m.plan, tiny_groups)["mlp_down"]
    assert mlp == {(0, "nvfp4"), (1, "nvfp4"), (2, "nvfp4"), (3, "fp8")}
    for kind in ("gdn_in", "gdn_out", "attn_qkv", "attn_o"):
        assert _formats(m.plan, tiny_groups, kind) == {"fp8"}, kind
    for kind in ("gdn_ab", "lm_head", "vision"):
        assert _formats(m.plan, tiny_groups, kind) == {"bf16"}, kind
    assert m.unmatched == []


def test_every_recipe_maps_every_group_and_keeps_bf16_groups(tiny_groups):
    for r in peers.select("all"):
        m = r.map(tiny_groups)
        assert set(m.plan) == {g.name for g in tiny_groups}
        check_plan(m.plan, tiny_groups, "h200", r.name)  # what export accepts


def _recipe(tmp_path, body: str):
    p = tmp_path / "r.yaml"
    p.write_text("name: r\nsource: test\n" + body)
    return p


def test_unknown_kind_is_an_error_naming_it(tmp_path):
    p = _recipe(tmp_path, "default: fp8\nrules:\n  - {kinds: [mlp_gate], format: bf16}\n")
    with pytest.raises(OcriaError, match="unknown layer group kind 'mlp_gate'"):
        peers.load_recipe(p)


def test_bad_format_layers_keys_and_pinned_groups_are_errors(tmp_path):
    for body, msg in (("rules:\n  - {kinds: [mlp], format: int4}\n", "unknown format 'int4'"),
                      ("default: fp6\n", "unknown default format 'fp6'"),
                      ("rules:\n  - {kinds: [mlp], layers: middle 3, format: fp8}\n", "bad layers 'middle 3'"),
                      ("rules:\n  - {kind: [mlp], format: fp8}\n", "unknown rule keys \\['kind'\\]"),
                      ("rules:\n  - {kinds: [vision], format: fp8}\n", "vision groups always stay BF16"),
                      ("rules:\n  - {kinds: [gdn_ab], format: nvfp4}\n", "gdn_ab groups always stay BF16"),
                      ("rules:\n  - {kinds: [mtp], format: fp8}\n", "carries mtp"),
                      ("dflt: fp8\n", "unknown keys \\['dflt'\\]")):
        with pytest.raises(OcriaError, match=msg):
            peers.load_recipe(_recipe(tmp_path, body))
    with pytest.raises(OcriaError, match="no peer recipe 'nope'.*llmcompressor-nvfp4"):
        peers.load_recipe("nope")


def test_rules_that_decide_no_group_are_reported(tmp_path, tiny_groups):
    p = _recipe(tmp_path, "default: nvfp4\nrules:\n"
                          "  - {kinds: [mlp], layers: 10-12, format: fp8}\n"      # past the model's end
                          "  - {kinds: [self_attn], format: bf16}\n"
                          "  - {kinds: [attn_o], format: fp8}\n"                  # shadowed by the rule above
                          "  - {kinds: linear_attn, format: fp8}\n")              # gdn_ab inside stays BF16
    m = peers.load_recipe(p).map(tiny_groups)
    assert len(m.unmatched) == 2
    assert "mlp in layers 10-12 -> fp8" in m.unmatched[0] and "4 decoder layers" in m.unmatched[0]
    assert "attn_o -> fp8" in m.unmatched[1] and "earlier rule" in m.unmatched[1]
    assert m.plan["layers.0.gdn_ab"] == "bf16" and m.plan["layers.0.gdn_in"] == "fp8"
    assert m.plan["layers.3.attn_o"] == "bf16" and m.plan["layers.0.mlp_up"] == "nvfp4"
    assert m.plan["vision"] == "bf16"  # default never reaches always-BF16 groups


def test_layer_selectors():
    assert peers.parse_layers("last 25%", 32) == set(range(24, 32))
    assert peers.parse_layers("last 25%", 8) == {6, 7}
    assert peers.parse_layers("last 10%", 8) == {7}  # rounded up
    assert peers.parse_layers("first 2", 8) == {0, 1}
    assert peers.parse_layers("last 20", 8) == set(range(8))
    assert peers.parse_layers("2-4", 8) == {2, 3, 4}
    assert peers.parse_layers([0, 9], 8) == {0}
    assert peers.parse_layers(5, 8) == {5}
    for bad in ("4-2", "first 1.5", "most", True):
        with pytest.raises(ValueError):
            peers.parse_layers(bad, 8)


def test_select_none_all_and_names():
    assert peers.select("none") == [] and peers.select(None) == []
    assert [r.name for r in peers.select("qwen-fp8, nvidia-nvfp4-mlp")] == ["qwen-fp8", "nvidia-nvfp4-mlp"]
    assert len(peers.select("all")) == 4
    with pytest.raises(OcriaError, match="no peer recipe 'llmc'"):
        peers.select("llmc")
    with pytest.raises(OcriaError, match="none, all, or"):
        peers.select("all,qwen-fp8")


def test_recipe_plan_for_export(tiny_model_dir, tmp_path):
    plan = peers.save_recipe_plan("llmcompressor-nvfp4", tmp_path / "plan.json", tiny_model_dir, target="b200")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded.groups == plan.groups and loaded.target == "b200"
    assert loaded.model_dir == tiny_model_dir and loaded.model_fingerprint == model_fingerprint(tiny_model_dir)
    assert loaded.evidence["recipe"]["name"] == "llmcompressor-nvfp4" and loaded.evidence["unmatched_rules"]
    assert plan.groups["layers.3.mlp_up"] == "nvfp4" and plan.groups["layers.0.gdn_in"] == "bf16"
    loaded.check_model(tiny_model_dir)
    with pytest.raises(OcriaError, match="unknown target"):
        peers.recipe_plan("qwen-fp8", tiny_model_dir, target="a100")


def test_every_recipe_builds_an_llmcompressor_recipe(tiny_groups):
    """What `export --recipe NAME` hands llmcompressor: one config group per format with the exact
    members of the recipe's groups; every other Linear ignored by name."""
    from ocriaquant.export import build_recipe

    for r in peers.select("all"):
        plan = r.map(tiny_groups).plan
        mod = build_recipe(plan, tiny_groups, "h200", r.name)
        for fmt in ("fp8", "nvfp4"):
            want = sorted(m for g in tiny_groups if plan[g.name] == fmt for m in g.members)
            got = sorted(mod.config_groups[fmt].targets) if fmt in mod.config_groups else []
            assert got == want, (r.name, fmt)
        assert "lm_head" in mod.ignore and not any("in_proj_a" in t for s in mod.config_groups.values()
                                                   for t in s.targets)


def test_export_recipe_ships_a_published_recipe_as_it_stands(tiny_model_dir, tmp_path):
    """`ocriaquant export --recipe NAME` writes the recipe's layout for the given model: NVIDIA's
    recipe puts the MLPs alone in NVFP4."""
    import json

    from typer.testing import CliRunner

    from ocriaquant.cli import app

    out = tmp_path / "ckpt"
    res = CliRunner().invoke(app, ["export", "--recipe", "nvidia-nvfp4-mlp", "--model", str(tiny_model_dir),
                                   "--out", str(out), "--max-pages", "2", "--verify-pages", "0"])
    assert res.exit_code == 0, res.output
    groups = json.loads((out / "ocriaquant.json").read_text())["plan"]["groups"]
    assert {g: f for g, f in groups.items() if f != "bf16"} == {g: "nvfp4" for g in groups if ".mlp_" in g}
    assert any(".mlp_" in g for g in groups)
