"""`ocriaquant export`: plan -> llmcompressor recipe -> compressed-tensors checkpoint.

The recipe has one config group per format with the exact module names of the plan's
groups and ignores every other Linear by exact name (the vision tower, gdn_ab, BF16 groups).
FP8 is the FP8_DYNAMIC preset (W8A8). NVFP4 follows the plan's target: `b200` gets the NVFP4
preset (W4A4, static input global scale), `h200` the NVFP4A16 preset (weight-only), because
that is what the plan was judged with and what a Hopper GPU runs (vLLM runs NVFP4 weight-only
on Hopper, and transformers would otherwise emulate W4A4 on reload and disagree with search).
A plan that gives the shards of a module vLLM fuses (q/k/v, gate/up, in_proj_qkv + in_proj_z,
in_proj_a + in_proj_b) different schemes is refused, naming the module.

After `oneshot`, before the checkpoint is compressed:
- the parameters of every module that is neither a Linear nor an Embedding (norms, conv1d,
  A_log, dt_bias, ...) are put back as they were (`restore_small_tensors`: oneshot rounds the
  Qwen3.5 offset-RMSNorm weights through BF16 `1 + w`);
- llmcompressor ties the NVFP4 global scale of q/k/v and gate/up but not of the GDN pair
  in_proj_qkv + in_proj_z, which vLLM fuses at load and would then run with the larger of two
  scales; `retie_global_scales` gives every fused unit one global scale and recomputes its block
  scales in our (compressed-tensors-exact) numerics.
So the checkpoint, reloaded, computes bit for bit what search simulated (quant/simulate.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .artifacts import check_plan, input_absmax, is_calibration, load_calibration, load_plan
from .errors import OcriaError
from .files import replace_dir, temp_sibling
from .model.groups import LayerGroup
from .model.mtp import add_shard
from .quant import nvfp4


NVFP4_PRESET = {"h200": "NVFP4A16", "b200": "NVFP4"}


@dataclass(frozen=True)
class ExportOptions:
    max_pages: int = 16       # calibration pages fed to llmcompressor's oneshot
    verify_pages: int = 16    # held-out pages the reloaded checkpoint is checked on (0: skip the check)
    force: bool = False       # replace an existing `out`, once the new checkpoint is complete


def build_recipe(plan: dict[str, str], groups: list[LayerGroup], target: str, source: str | Path = "plan"):
    """The llmcompressor recipe of a plan, checked against the model's groups (`source` names
    the plan in errors)."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    check_plan(plan, groups, target, source)
    by_name = {g.name: g for g in groups}
    members = {"fp8": [], "nvfp4": []}
    for name, fmt in plan.items():
        if fmt != "bf16":
            members[fmt] += by_name[name].members
    quantized = set(members["fp8"]) | set(members["nvfp4"])
    if not quantized:
        raise OcriaError(f"{source} quantizes no group: an all-BF16 plan needs no export")
    scheme = {m: fmt for fmt, names in members.items() for m in names}
    check_fused_schemes({m: scheme.get(m, "bf16") for g in groups for m in g.members}, source)
    preset = {"fp8": "FP8_DYNAMIC", "nvfp4": NVFP4_PRESET[target]}
    config_groups = {fmt: preset_name_to_scheme(preset[fmt], names) for fmt, names in members.items() if names}
    ignore = [m for g in groups for m in g.members if m not in quantized]
    return QuantizationModifier(config_groups=config_groups, ignore=ignore)


# The shards vLLM fuses into one weight at load (its packed_modules_mapping for Qwen3.5): every
# shard of one fused module must carry the same quantization scheme, or vLLM refuses the checkpoint.
VLLM_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
              "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_a", "in_proj_b")}


def check_fused_schemes(schemes: dict[str, str], source: str | Path = "plan") -> None:
    """Refuse a module -> scheme assignment (bf16 / fp8 / nvfp4; every Linear of the model) that
    gives the shards of a module vLLM fuses different schemes, naming the fused module and its shards."""
    shard_of = {s: fused for fused, shards in VLLM_FUSED.items() for s in shards}
    units: dict[str, dict[str, str]] = {}
    for name, fmt in schemes.items():
        parent, _, leaf = name.rpartition(".")
        if leaf in shard_of:
            units.setdefault(f"{parent}.{shard_of[leaf]}" if parent else shard_of[leaf], {})[name] = fmt
    for fused, shards in sorted(units.items()):
        if len(set(shards.values())) > 1:
            parts = ", ".join(f"{n.rpartition('.')[2]} {f}" for n, f in shards.items())
            raise OcriaError(f"{source} splits {fused} across schemes ({parts}): vLLM fuses these shards into one "
                             "weight and needs one scheme for all of them; give them one format")


@torch.no_grad()
def retie_global_scales(model, plan: dict[str, str], groups: list[LayerGroup]) -> int:
    """One NVFP4 global scale per fused unit (the smallest member scale = the largest absmax),
    block scales recomputed under it. Call after `oneshot`, before saving compressed.
    Returns the number of units whose scales changed."""
    changed = 0
    for g in groups:
        if plan.get(g.name) != "nvfp4" or len(g.members) < 2:
            continue
        mods = [model.get_submodule(m) for m in g.members]
        scales = torch.cat([m.weight_global_scale.reshape(1).float() for m in mods])
        shared = scales.min().reshape(1)
        if torch.all(scales == shared):
            continue
        changed += 1
        for m in mods:
            w = m.weight.detach()
            blocks = nvfp4.block_scales(w.unflatten(-1, (w.shape[-1] // nvfp4.NVFP4_GROUP, nvfp4.NVFP4_GROUP)),
                                        shared.to(w.device))
            m.weight_scale.data.copy_(blocks.to(m.weight_scale.dtype).reshape(m.weight_scale.shape))
            m.weight_global_scale.data.copy_(shared.to(m.weight_global_scale.dtype).reshape(m.weight_global_scale.shape))
    return changed


def snapshot_small_tensors(model) -> dict[str, torch.Tensor]:
    """Copies of the parameters of every module that is neither a Linear nor an Embedding (norms,
    conv1d, A_log, dt_bias, the vision tower's patch conv and LayerNorms): small, and nothing
    llmcompressor should change. Taken before `oneshot`, put back by `restore_small_tensors`."""
    from torch import nn

    return {f"{m}.{n}" if m else n: p.detach().clone()
            for m, mod in model.named_modules() if not isinstance(mod, (nn.Linear, nn.Embedding))
            for n, p in mod.named_parameters(recurse=False)}


@torch.no_grad()
def restore_small_tensors(model, snapshot: dict[str, torch.Tensor]) -> int:
    """Put back what `oneshot` changed among `snapshot`'s tensors; returns how many it had changed.

    llmcompressor's oneshot runs calibration inside `norm_calibration_context`, which turns every
    Qwen3.5 offset RMSNorm (`x * (1 + w)`) into a plain one holding `1 + w` in BF16 and on exit
    writes back `(1 + w) - 1`: w loses its low bits to the BF16 grid near 1 (steps of 2^-7), so
    the checkpoint's input/post-attention/q/k/final norms were not the model's, and its reload no
    longer computed what search simulated (issue #58, page-0003). The norms are not quantized:
    they must leave export exactly as they came in."""
    changed = 0
    for name, saved in snapshot.items():
        p = model.get_parameter(name)
        if p.dtype == saved.dtype and p.shape == saved.shape:
            if torch.equal(p, saved.to(p.device)):
                continue
            p.data.copy_(saved)
        else:
            p.data = saved.to(p.device)
        changed += 1
    return changed


def calibration_dataset(processor, pages):
    """`datasets.Dataset` of processed page requests (prompt + ground truth), one page a row,
    for llmcompressor's observers. `mm_token_type_ids` is kept: without it transformers puts
    the image tokens at the wrong positions."""
    from datasets import Dataset

    from .model.processor import chat_text

    rows = []
    for p in pages:
        text = chat_text(processor, p.prompt) + (p.reference or "")
        enc = processor(images=[p.image], text=[text], return_tensors="pt")
        rows.append({k: v.tolist() for k, v in enc.items()})
    return Dataset.from_list(rows)


def collate_one(batch):
    """oneshot's collator: one page per batch, tensors as the model's forward takes them."""
    if len(batch) != 1:
        raise ValueError("calibration batches hold one page")
    row = batch[0]
    out = {k: torch.tensor(row[k]) for k in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw")}
    out["pixel_values"] = torch.tensor(row["pixel_values"], dtype=torch.bfloat16)
    return out


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("ocriaquant", "torch", "transformers", "llmcompressor", "compressed-tensors"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def set_input_global_scales(model, plan: dict[str, str], groups: list[LayerGroup],
                            absmax: dict[str, torch.Tensor]) -> int:
    """W4A4 (b200): the static input global scale of every NVFP4 member from the calibration's
    input absmax, the value search simulated with (llmcompressor's observer saw only the export's
    few pages). Members of a fused unit read the same input, so they get the same scale."""
    n = 0
    for g in groups:
        if plan.get(g.name) != "nvfp4":
            continue
        for m in g.members:
            mod = model.get_submodule(m)
            if m in absmax and hasattr(mod, "input_global_scale"):
                gs = nvfp4.global_scale_from_absmax(absmax[m].to(mod.weight.dtype))
                mod.input_global_scale.data.copy_(gs.reshape(mod.input_global_scale.shape))
                n += 1
    return n


def carry_unloaded_tensors(src: Path, dst: Path, prefixes: tuple[str, ...] = ("mtp.",)) -> int:
    """Copy tensors transformers does not load (Qwen3.5's multi-token-prediction head `mtp.*`)
    from the source checkpoint into `dst` untouched, as their own shard listed in the index
    (serving engines that speculate with MTP read them from there). Those the save already
    carried (llmcompressor copies `mtp.*` into model_mtp.safetensors) are checked, not written
    twice. Returns how many `dst` holds."""
    from safetensors import safe_open

    carried: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            meta = fh.metadata() or {}
            for k in fh.keys():
                if k.startswith(prefixes):
                    carried[k] = fh.get_tensor(k)
    if not carried:
        return 0
    index_path = dst / "model.safetensors.index.json"
    indexed = json.loads(index_path.read_text())["weight_map"] if index_path.exists() else {}
    missing = dict(carried)
    for shard in {indexed[k] for k in carried if k in indexed and (dst / indexed[k]).is_file()}:
        with safe_open(str(dst / shard), "pt") as fh:
            for k in set(fh.keys()) & set(missing):
                if indexed[k] == shard and torch.equal(fh.get_tensor(k), missing[k]):
                    del missing[k]  # already there, byte for byte
    if missing:
        add_shard(dst, "model-extra-mtp.safetensors", missing, meta.get("format", "pt"))
        _ignore_in_quantization(dst, [f"re:^{p.rstrip('.')}.*" for p in prefixes])  # as llmcompressor's own carry does
    return len(carried)


def _ignore_in_quantization(model_dir: Path, patterns: list[str]) -> None:
    """Add `patterns` to config.json's quantization_config.ignore: a serving engine must not look for
    quantized weights in modules we carried over in BF16 (vLLM builds the MTP drafter with the
    model's quantization config)."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    quant = config.get("quantization_config")
    if quant is None:
        return
    ignore = quant.get("ignore") or []
    quant["ignore"] = ignore + [p for p in patterns if p not in ignore]
    path.write_text(json.dumps(config, indent=2) + "\n")


def verify(ckpt, model_dir, plan: dict[str, str], target: str, absmax: dict[str, torch.Tensor] | None, pages,
           max_new_tokens: int | None = None, console=None) -> dict:
    """Decode `pages` with the written checkpoint reloaded by transformers (a loader we did not
    write) and with search's simulation of the same plan on the BF16 model, both in BF16;
    count the pages whose greedy tokens are identical."""
    from .eval import ned
    from .model import discover_groups, load_model
    from .model.generate import default_max_new_tokens, greedy_decode
    from .quant.simulate import plan_units, simulate

    pages = list(pages)
    q, proc = load_model(ckpt, dtype="bf16")
    tok = proc.tokenizer
    max_new = max_new_tokens or default_max_new_tokens(tok, pages)

    def ids(texts):
        return [tok(t)["input_ids"] for t in texts]

    got = greedy_decode(q, proc, pages, max_new_tokens=max_new)
    del q
    net, _ = load_model(model_dir, dtype="bf16")
    with simulate(net, plan_units(plan, {g.name: g.members for g in discover_groups(net)}, target), absmax):
        want = greedy_decode(net, proc, pages, max_new_tokens=max_new)
    same = [a == b for a, b in zip(ids(got), ids(want))]
    res = {"pages": len(pages), "identical_pages": int(sum(same)), "agreement": float(sum(same) / len(pages)),
           "dtype": "bf16", "target": target, "compared_with": "ocriaquant simulation of the plan (search)",
           "differing_pages": [p.name for p, s in zip(pages, same) if not s]}
    refs = [p for p in pages if p.reference]
    if refs:
        res["ned_checkpoint"] = float(sum(ned(g, p.reference) for g, p in zip(got, pages) if p.reference) / len(refs))
    return res


def export(plan_path, out, model=None, pages=None, options: ExportOptions | None = None, *, console=None,
           **fields) -> Path:
    """Write the plan's compressed-tensors checkpoint to `out`, atomically, then verify it.
    Fields of ExportOptions may also be given by name (`verify_pages=0`).

    Everything is written to a hidden sibling directory first and renamed into place at the
    end, so a failure midway leaves no partial `out` (and an existing `out` with --force is
    only replaced once the new checkpoint is complete). With `verify_pages` > 0 the checkpoint
    is reloaded with transformers and compared token for token with search's simulation on
    that many held-out pages; the agreement goes into ocriaquant.json."""
    import shutil
    import time

    import yaml
    from rich.console import Console

    from .data import BUNDLED_PAGES, load_pages, select_split
    from .model import discover_groups, load_model
    from .model.processor import save_processor

    opts = replace(options or ExportOptions(), **fields)
    console = console or Console(stderr=True)
    plan_path, out = Path(plan_path), Path(out)
    plan = load_plan(plan_path)
    target = plan.target
    if out.exists() and not opts.force:
        raise OcriaError(f"{out}: already exists; choose another --out or pass --force to replace it")
    if model is None and plan.model_dir is None:
        raise OcriaError(f"{plan_path}: names no model directory; pass --model")
    model_dir = Path(model) if model is not None else plan.model_dir
    plan.check_model(model_dir)
    # The W4A4 input scales search simulated with, where the plan's calibration is still there.
    absmax = None
    if plan.calibration and is_calibration(plan.calibration):
        absmax = input_absmax(load_calibration(plan.calibration).stats)

    from llmcompressor import oneshot

    t0 = time.time()
    net, proc = load_model(model_dir, dtype="bf16")
    groups = discover_groups(net)
    recipe = build_recipe(plan.groups, groups, target, plan_path)  # validates the plan before any work
    all_pages = load_pages(Path(pages) if pages else BUNDLED_PAGES).pages
    calib_pages = select_split(all_pages, "calibration")[:opts.max_pages]
    tmp = temp_sibling(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        small = snapshot_small_tensors(net)
        oneshot(model=net, recipe=recipe, dataset=calibration_dataset(proc, calib_pages), data_collator=collate_one,
                num_calibration_samples=len(calib_pages), sequential_targets=["Qwen3_5DecoderLayer"], processor=proc)
        restored = restore_small_tensors(net, small)
        del small
        retied = retie_global_scales(net, plan.groups, groups)
        in_scales = set_input_global_scales(net, plan.groups, groups, absmax) if absmax and target == "b200" else 0
        net.save_pretrained(tmp, save_compressed=True)
        del net
        carried = carry_unloaded_tensors(model_dir, tmp)
        save_processor(proc, tmp)
        (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json", exclude_none=True)))
        meta = {"plan": plan.to_json(), "target": target, "calibration_fingerprint": plan.model_fingerprint,
                "retied_fused_units": retied, "restored_tensors": restored,
                "input_global_scales_from_calibration": in_scales,
                "carried_tensors": carried, "calibration_pages": [p.name for p in calib_pages],
                "export_seconds": round(time.time() - t0, 1), "versions": _versions()}
        if opts.verify_pages:
            held = [p for p in select_split(all_pages, "heldout") if p.has_reference][:opts.verify_pages]
            if held:
                console.print(f"verifying: transformers reload vs search's simulation on {len(held)} held-out pages")
                meta["verification"] = verify(tmp, model_dir, plan.groups, target, absmax, held, console=console)
                v = meta["verification"]
                console.print(f"verification: {v['identical_pages']}/{v['pages']} pages token-identical "
                              f"({v['agreement']:.0%})")
        (tmp / "ocriaquant.json").write_text(json.dumps(meta, indent=1))
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
