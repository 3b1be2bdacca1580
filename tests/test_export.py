import json
import os

import pytest
import torch
from safetensors.torch import load_file

from ocriaquant.artifacts import Plan, check_plan, load_plan, model_fingerprint, save_plan
from ocriaquant.data import load_pages
from ocriaquant.errors import OcriaError
from ocriaquant.export import ExportOptions, build_recipe, calibration_dataset, collate_one, retie_global_scales
from ocriaquant.model import discover_groups, load_config, load_model, meta_model
from ocriaquant.quant import fp8, nvfp4

PLAN = {"layers.0.gdn_in": "nvfp4", "layers.0.mlp_up": "nvfp4", "layers.3.attn_qkv": "fp8",
        "layers.1.mlp_down": "fp8", "lm_head": "bf16"}


def test_recipe_has_exact_names_and_ignore_list(tiny_model_dir):
    model, _ = load_model(tiny_model_dir)
    groups = discover_groups(model)
    recipe = build_recipe(PLAN, groups, "b200")
    cg = recipe.config_groups
    by = {g.name: g for g in groups}
    assert sorted(cg["nvfp4"].targets) == sorted(by["layers.0.gdn_in"].members + by["layers.0.mlp_up"].members)
    assert sorted(cg["fp8"].targets) == sorted(by["layers.3.attn_qkv"].members + by["layers.1.mlp_down"].members)
    assert cg["nvfp4"].weights.group_size == 16 and cg["fp8"].input_activations.dynamic
    quantized = set(cg["nvfp4"].targets) | set(cg["fp8"].targets)
    every = {m for g in groups for m in g.members}
    assert set(recipe.ignore) == every - quantized
    assert set(by["vision"].members) <= set(recipe.ignore) and "lm_head" in recipe.ignore
    with pytest.raises(OcriaError, match="unknown layer groups: layers.99.mlp_up"):
        build_recipe({"layers.99.mlp_up": "fp8"}, groups, "h200")
    with pytest.raises(OcriaError, match="always stay BF16"):
        build_recipe({"layers.0.gdn_ab": "fp8"}, groups, "h200")
    with pytest.raises(OcriaError, match="unknown format 'int4'"):
        build_recipe({"layers.0.mlp_up": "int4"}, groups, "h200")
    with pytest.raises(OcriaError, match="unknown target 'a100'"):
        build_recipe(PLAN, groups, "a100")
    # h200 plans are judged weight-only (W4A16) and exported so; b200 keeps the W4A4 activations.
    h200 = build_recipe(PLAN, groups, "h200").config_groups
    assert h200["nvfp4"].input_activations is None and cg["nvfp4"].input_activations is not None
    assert h200["fp8"].input_activations.dynamic


def test_plan_round_trips_and_names_its_file_in_errors(tiny_model_dir, tmp_path):
    """search writes, export reads: the plan keeps its numbers, and a plan this model cannot take
    is refused naming the groups and the file, before any weights are read."""
    groups = discover_groups(meta_model(load_config(tiny_model_dir)))
    plan = Plan(groups=PLAN, target="b200", model_dir=tiny_model_dir, calibration=tmp_path / "calib",
                model_fingerprint="f" * 32, evidence={"batch": 8, "tolerance": 0.02})
    save_plan(tmp_path / "plan.json", plan)
    back = load_plan(tmp_path / "plan.json")
    assert back == plan and back.path == tmp_path / "plan.json"
    check_plan(back.groups, groups, back.target, back.path)
    with pytest.raises(OcriaError, match=r"plan\.json names unknown layer groups: layers\.42\.mlp_up, layers\.9\.attn_o"):
        check_plan({"layers.9.attn_o": "fp8", "layers.42.mlp_up": "fp8"}, groups, "h200", back.path)
    (tmp_path / "bad.json").write_text(json.dumps({"target": "h200", "groups": {"lm_head": "int4"}}))
    with pytest.raises(OcriaError, match="bad.json gives 'lm_head' the unknown format 'int4'"):
        load_plan(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text(json.dumps({"target": "a100", "groups": {}}))
    with pytest.raises(OcriaError, match="bad.json names the unknown target 'a100'"):
        load_plan(tmp_path / "bad.json")


def test_oneshot_checkpoint_matches_our_numerics_with_tied_gdn_scales(tiny_model_dir, synth_pages, tmp_path):
    from llmcompressor import oneshot

    model, proc = load_model(tiny_model_dir)
    groups = discover_groups(model)
    original = {m: model.get_submodule(m).weight.detach().clone() for g in groups for m in g.members}
    pages = load_pages(synth_pages).pages[:2]
    oneshot(model=model, recipe=build_recipe(PLAN, groups, "b200"), dataset=calibration_dataset(proc, pages),
            data_collator=collate_one, num_calibration_samples=2, sequential_targets=["Qwen3_5DecoderLayer"],
            processor=proc)
    assert retie_global_scales(model, PLAN, groups) >= 1  # llmcompressor leaves the GDN pair untied
    model.save_pretrained(tmp_path / "ckpt", save_compressed=True)

    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "mixed-precision" and len(cfg["config_groups"]) == 2
    by = {g.name: g for g in groups}
    targets = {grp["weights"]["num_bits"]: sorted(grp["targets"]) for grp in cfg["config_groups"].values()}
    assert targets[4] == sorted(by["layers.0.gdn_in"].members + by["layers.0.mlp_up"].members)
    assert targets[8] == sorted(by["layers.3.attn_qkv"].members + by["layers.1.mlp_down"].members)
    assert set(by["vision"].members) <= set(cfg["ignore"])
    sd = {}
    for f in (tmp_path / "ckpt").glob("*.safetensors"):
        sd.update(load_file(str(f)))
    for unit in ("layers.0.gdn_in", "layers.0.mlp_up"):
        members = by[unit].members
        gs = nvfp4.global_scale(*(original[m] for m in members))
        for m in members:
            assert torch.equal(sd[m + ".weight_global_scale"].float(), gs), m
            packed, scales, _ = nvfp4.quantize_weight(original[m], gs)
            assert torch.equal(sd[m + ".weight_packed"], packed), m
            assert torch.equal(sd[m + ".weight_scale"].view(torch.uint8), scales.view(torch.uint8)), m
    for m in by["layers.3.attn_qkv"].members + by["layers.1.mlp_down"].members:
        q, s = fp8.quantize_weight(original[m])
        assert torch.equal(sd[m + ".weight"].view(torch.uint8), q.view(torch.uint8)), m
        assert torch.equal(sd[m + ".weight_scale"], s), m
    # Unquantized Linears are stored as they were.
    vis = by["vision"].members[0]
    assert torch.equal(sd[vis + ".weight"], original[vis])


def _plan_file(tmp_path, model_dir, groups=None, target="h200"):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps({"target": target, "groups": groups or PLAN, "model_dir": str(model_dir),
                             "calibration": {"fingerprint": model_fingerprint(model_dir)}}))
    return p


def test_export_writes_a_checkpoint_atomically_and_refuses_to_overwrite(tiny_model_dir, synth_pages, tmp_path,
                                                                         monkeypatch):
    from ocriaquant import export as ex

    plan = _plan_file(tmp_path, tiny_model_dir)
    out = ex.export(plan, tmp_path / "ckpt", pages=synth_pages, options=ExportOptions(max_pages=2, verify_pages=0))
    names = {f.name for f in out.iterdir()}
    assert {"config.json", "recipe.yaml", "ocriaquant.json", "tokenizer.json", "preprocessor_config.json"} <= names
    meta = json.loads((out / "ocriaquant.json").read_text())
    assert meta["retied_fused_units"] >= 1 and meta["versions"]["llmcompressor"]
    # readable by a server running as another user: the mode open() gives, not safetensors' owner-only 0o600
    mask = os.umask(0)
    os.umask(mask)
    assert {f.stat().st_mode & 0o777 for f in out.iterdir()} == {0o666 & ~mask}
    with pytest.raises(OcriaError, match="already exists.*--force"):
        ex.export(plan, out, pages=synth_pages, max_pages=2)

    # A failure midway leaves neither a partial checkpoint nor a temporary directory behind,
    # and with --force the old checkpoint survives until the new one is complete.
    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr("ocriaquant.model.processor.save_processor", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        ex.export(plan, tmp_path / "new", pages=synth_pages, max_pages=2)
    with pytest.raises(RuntimeError, match="disk full"):
        ex.export(plan, out, pages=synth_pages, max_pages=2, force=True)
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert json.loads((out / "ocriaquant.json").read_text()) == meta


def test_export_rejects_bad_plans_and_other_models(tiny_model_dir, synth_pages, tmp_path):
    from ocriaquant.export import export

    bad = _plan_file(tmp_path, tiny_model_dir, {"layers.42.mlp_up": "fp8"})
    with pytest.raises(OcriaError, match="layers.42.mlp_up"):
        export(bad, tmp_path / "x", pages=synth_pages)
    plan = _plan_file(tmp_path, tiny_model_dir)
    doc = json.loads(plan.read_text())
    doc["calibration"]["fingerprint"] = "0" * 32
    plan.write_text(json.dumps(doc))
    with pytest.raises(OcriaError, match="does not match the model"):
        export(plan, tmp_path / "x", pages=synth_pages)
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(OcriaError, match="not a plan"):
        export(tmp_path / "junk.json", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_export_carries_mtp_and_reloads_token_identical_to_the_simulation(tiny_model_dir, synth_pages, tmp_path):
    """A real Qwen3.5 checkpoint holds `mtp.*` tensors transformers does not load: they must
    survive export byte for byte. And transformers' reload of the checkpoint must decode the
    same tokens as search's simulation of the plan (the check export records)."""
    import shutil

    from safetensors.torch import save_file

    from ocriaquant.export import export

    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir, src)
    torch.manual_seed(3)
    mtp = {"mtp.fc.weight": torch.randn(64, 128, dtype=torch.bfloat16),
           "mtp.norm.weight": torch.randn(64, dtype=torch.bfloat16)}
    save_file(mtp, str(src / "mtp.safetensors"), metadata={"format": "pt"})
    plan = _plan_file(tmp_path, src)
    out = export(plan, tmp_path / "ckpt", pages=synth_pages, max_pages=2, verify_pages=3)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for k, v in mtp.items():
        assert torch.equal(load_file(str(out / index[k]))[k], v)
    assert any(f != index["mtp.fc.weight"] for f in index.values())  # the model's own weights are indexed too
    from safetensors import safe_open

    holders = []
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            holders += [f.name] if any(k.startswith("mtp.") for k in fh.keys()) else []
    assert holders == [index["mtp.fc.weight"]]  # one copy, the indexed one (llmcompressor's or ours)
    meta = json.loads((out / "ocriaquant.json").read_text())
    assert meta["carried_tensors"] == 2
    v = meta["verification"]
    assert v["pages"] == 3 and v["agreement"] == 1.0, v
    # transformers still loads the checkpoint through the index
    model, _ = load_model(out)
    scheme = model.get_submodule("model.language_model.layers.0.mlp.gate_proj").quantization_scheme
    assert scheme.weights.num_bits == 4 and scheme.input_activations is None  # h200: weight-only


def test_mtp_carried_once_where_the_save_already_carried_it(tmp_path):
    """llmcompressor's save copies `mtp.*` into model_mtp.safetensors and indexes it: export checks
    those tensors and writes no second copy; where the save carried none, export adds its shard."""
    from safetensors.torch import save_file

    from ocriaquant.export import carry_unloaded_tensors

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    mtp = {"mtp.fc.weight": torch.randn(8, 16, dtype=torch.bfloat16), "mtp.norm.weight": torch.randn(8)}
    save_file({"w": torch.zeros(2), **mtp}, str(src / "model.safetensors"))
    save_file({"w": torch.zeros(2)}, str(dst / "model.safetensors"))
    save_file(mtp, str(dst / "model_mtp.safetensors"))
    index = {"metadata": {}, "weight_map": {"w": "model.safetensors", **{k: "model_mtp.safetensors" for k in mtp}}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    assert carry_unloaded_tensors(src, dst) == 2
    assert sorted(f.name for f in dst.glob("*.safetensors")) == ["model.safetensors", "model_mtp.safetensors"]
    config = {"quantization_config": {"ignore": ["lm_head"]}}
    (dst / "config.json").write_text(json.dumps(config))
    assert carry_unloaded_tensors(src, dst) == 2
    assert json.loads((dst / "config.json").read_text()) == config  # the save's own carry is left as it was
    (dst / "model_mtp.safetensors").unlink()  # a save that carried nothing
    (dst / "model.safetensors.index.json").unlink()
    assert carry_unloaded_tensors(src, dst) == 2
    weight_map = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert {weight_map[k] for k in mtp} == {"model-extra-mtp.safetensors"}
    # a serving engine must not expect quantized MTP weights
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head", "re:^mtp.*"]
    for k, v in mtp.items():
        assert torch.equal(load_file(str(dst / "model-extra-mtp.safetensors"))[k], v)


# The bundled model, its real trained weights, exported with a mixed plan: fused GDN / q,k,v / gate,up
# units in NVFP4 and in FP8, and the tied lm_head in FP8 (as the README's main job chooses it).
NANO_PLAN = {"layers.0.gdn_in": "fp8", "layers.0.mlp_up": "nvfp4", "layers.0.mlp_down": "fp8",
             "layers.1.gdn_in": "nvfp4", "layers.1.gdn_out": "fp8", "layers.3.attn_qkv": "fp8",
             "layers.3.attn_o": "nvfp4", "layers.5.gdn_out": "nvfp4", "layers.7.attn_qkv": "nvfp4",
             "layers.7.mlp_up": "fp8", "layers.7.mlp_down": "nvfp4", "lm_head": "fp8"}


def _nano_plan(folder):
    from ocriaquant.model import DEFAULT_MODEL

    folder.mkdir(parents=True, exist_ok=True)
    save_plan(folder / "plan.json", Plan(groups=NANO_PLAN, target="h200", model_dir=DEFAULT_MODEL,
                                         model_fingerprint=model_fingerprint(DEFAULT_MODEL)))
    return folder / "plan.json"


@pytest.fixture(scope="module")
def nano_export(tmp_path_factory):
    from ocriaquant.data import BUNDLED_PAGES
    from ocriaquant.export import export

    root = tmp_path_factory.mktemp("nano-export")
    plan = _nano_plan(root / "a")
    return plan, export(plan, root / "a" / "ckpt", pages=BUNDLED_PAGES, max_pages=2, verify_pages=0)


def test_export_keeps_unquantized_tensors_and_reloads_bit_exact_with_the_simulation(nano_export):
    """simulation ≡ export, bit for bit: every tensor the plan does not quantize leaves export as it
    came in (llmcompressor's oneshot rounds the Qwen3.5 offset-RMSNorm weights through BF16 `1 + w`;
    issue #58, page-0003 decoded differently), and the reloaded checkpoint's logits on a held-out
    page equal search's simulation's exactly."""
    from ocriaquant.data import BUNDLED_PAGES, select_split
    from ocriaquant.model import DEFAULT_MODEL
    from ocriaquant.model.processor import chat_text
    from ocriaquant.quant.simulate import plan_units, simulate

    _, ckpt = nano_export
    assert json.loads((ckpt / "ocriaquant.json").read_text())["restored_tensors"] > 0  # oneshot did change them
    q, proc = load_model(ckpt)
    net, _ = load_model(DEFAULT_MODEL)
    groups = discover_groups(net)
    quantized = {m for g in groups if NANO_PLAN.get(g.name, "bf16") != "bf16" for m in g.members}
    got = dict(q.named_parameters(remove_duplicate=False))
    kept = {n: p for n, p in net.named_parameters(remove_duplicate=False) if n.rpartition(".")[0] not in quantized}
    changed = [n for n, p in kept.items() if n not in got or not torch.equal(got[n], p)]
    assert not changed, f"{len(changed)} unquantized tensors changed by export, e.g. {changed[:3]}"

    page = next(p for p in select_split(load_pages(BUNDLED_PAGES).pages, "heldout") if p.name.startswith("page-0003"))
    enc = proc(images=[page.image], text=[chat_text(proc, page.prompt) + page.reference[:160]], return_tensors="pt")
    enc["pixel_values"] = enc["pixel_values"].to(torch.bfloat16)
    with torch.no_grad():
        reloaded = q(**enc).logits
        with simulate(net, plan_units(NANO_PLAN, {g.name: g.members for g in groups}, "h200")):
            simulated = net(**enc).logits
    assert torch.equal(reloaded, simulated), (reloaded.float() - simulated.float()).abs().max()


def test_two_exports_of_a_plan_are_byte_identical(nano_export, tmp_path):
    """Same plan, same model, same pages, another folder: the same bytes in every tensor file,
    config, recipe and plan (only the export's duration may differ)."""
    from ocriaquant.data import BUNDLED_PAGES
    from ocriaquant.export import export

    plan_a, a = nano_export
    plan_b = _nano_plan(tmp_path / "b")
    b = export(plan_b, tmp_path / "b" / "ckpt", pages=BUNDLED_PAGES, max_pages=2, verify_pages=0)
    assert plan_a.read_bytes() == plan_b.read_bytes()
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and any(f.endswith(".safetensors") for f in files)
    for f in files:
        if f != "ocriaquant.json":
            assert (a / f).read_bytes() == (b / f).read_bytes(), f
    meta_a, meta_b = (json.loads((d / "ocriaquant.json").read_text()) for d in (a, b))
    meta_a.pop("export_seconds"), meta_b.pop("export_seconds")
    assert meta_a == meta_b


def test_export_refuses_a_plan_that_splits_a_module_vllm_fuses(tiny_model_dir):
    """vLLM loads q/k/v, gate/up, in_proj_qkv + in_proj_z and in_proj_a + in_proj_b as one weight each:
    their shards need one scheme. Our groups keep them together; a plan over other groups is refused
    by name."""
    from ocriaquant.export import check_fused_schemes
    from ocriaquant.model.groups import LayerGroup

    model, _ = load_model(tiny_model_dir)
    groups = discover_groups(model)
    by = {g.name: g for g in groups}
    qkv, z = by["layers.0.gdn_in"].members
    split = [g for g in groups if g.name != "layers.0.gdn_in"] + [
        LayerGroup("layers.0.gdn_qkv", "gdn_out", 0, [qkv]), LayerGroup("layers.0.gdn_z", "gdn_out", 0, [z])]
    with pytest.raises(OcriaError, match=r"splits model\.language_model\.layers\.0\.linear_attn\.in_proj_qkvz across "
                                         r"schemes \(in_proj_qkv nvfp4, in_proj_z fp8\)"):
        build_recipe({"layers.0.gdn_qkv": "nvfp4", "layers.0.gdn_z": "fp8"}, split, "h200")
    with pytest.raises(OcriaError, match=r"layers\.0\.linear_attn\.in_proj_qkvz.*in_proj_z bf16"):
        build_recipe({"layers.0.gdn_qkv": "fp8"}, split, "h200")
    build_recipe({"layers.0.gdn_qkv": "fp8", "layers.0.gdn_z": "fp8"}, split, "h200")  # one scheme: fine
    attn = by["layers.3.attn_qkv"].members
    with pytest.raises(OcriaError, match=r"layers\.3\.self_attn\.qkv_proj.*k_proj bf16"):
        check_fused_schemes({attn[0]: "fp8", attn[1]: "bf16", attn[2]: "fp8"}, "p.json")
    a, b = by["layers.0.gdn_ab"].members
    with pytest.raises(OcriaError, match=r"p\.json splits .*in_proj_ba"):
        check_fused_schemes({a: "bf16", b: "nvfp4"}, "p.json")
    up = by["layers.2.mlp_up"].members
    with pytest.raises(OcriaError, match=r"layers\.2\.mlp\.gate_up_proj"):
        check_fused_schemes({up[0]: "nvfp4", up[1]: "fp8"})
    check_fused_schemes({m: "fp8" for m in attn + up})
