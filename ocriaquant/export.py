"""`ocriaquant export`: plan -> llmcompressor recipe -> compressed-tensors checkpoint.

The recipe has one config group per format with the exact module names of the plan's
groups (FP8_DYNAMIC and NVFP4 presets) and ignores every other Linear by exact name (the
vision tower, gdn_ab, BF16 groups). llmcompressor ties the NVFP4 global scale of q/k/v and
gate/up but not of the GDN pair in_proj_qkv + in_proj_z, which vLLM fuses at load and would
then run with the larger of two scales; `retie_global_scales` gives every fused unit one
global scale and recomputes its block scales in our (compressed-tensors-exact) numerics
before the checkpoint is compressed.
"""

from __future__ import annotations

import torch

from .errors import OcriaError
from .model.groups import LayerGroup
from .quant import nvfp4


def build_recipe(plan: dict[str, str], groups: list[LayerGroup]):
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    by_name = {g.name: g for g in groups}
    unknown = sorted(set(plan) - set(by_name))
    if unknown:
        raise OcriaError(f"plan names unknown layer groups: {', '.join(unknown[:5])}"
                         f"{' …' if len(unknown) > 5 else ''} (see `ocriaquant info` for this model's groups)")
    members = {"fp8": [], "nvfp4": []}
    for name, fmt in plan.items():
        if fmt == "bf16":
            continue
        if fmt not in members:
            raise OcriaError(f"plan gives {name!r} the unknown format {fmt!r}; formats are bf16, fp8, nvfp4")
        if by_name[name].always_bf16:
            raise OcriaError(f"plan gives {name!r} {fmt}, but {by_name[name].kind} groups always stay BF16")
        members[fmt] += by_name[name].members
    quantized = set(members["fp8"]) | set(members["nvfp4"])
    if not quantized:
        raise OcriaError("plan quantizes no group: an all-BF16 plan needs no export")
    preset = {"fp8": "FP8_DYNAMIC", "nvfp4": "NVFP4"}
    config_groups = {fmt: preset_name_to_scheme(preset[fmt], names) for fmt, names in members.items() if names}
    ignore = [m for g in groups for m in g.members if m not in quantized]
    return QuantizationModifier(config_groups=config_groups, ignore=ignore)


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


def export(plan_path, out, model=None, pages=None, force: bool = False, max_pages: int = 16, console=None):
    """Write the plan's compressed-tensors checkpoint to `out`, atomically.

    Everything is written to a hidden sibling directory first and renamed into place at the
    end, so a failure midway leaves no partial `out` (and an existing `out` with --force is
    only replaced once the new checkpoint is complete)."""
    import json
    import os
    import shutil
    from pathlib import Path

    import yaml

    from .calibrate import model_fingerprint
    from .data import BUNDLED_PAGES, load_pages, select_split
    from .model import discover_groups, load_model
    from .model.processor import save_processor

    plan_path, out = Path(plan_path), Path(out)
    try:
        plan_doc = json.loads(plan_path.read_text())
        plan = plan_doc["groups"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise OcriaError(f"{plan_path}: not a plan written by `ocriaquant search` ({e})") from e
    if out.exists() and not force:
        raise OcriaError(f"{out}: already exists; choose another --out or pass --force to replace it")
    model_dir = Path(model or plan_doc.get("model_dir") or "")
    expected = (plan_doc.get("calibration") or {}).get("fingerprint")
    if expected and model_fingerprint(model_dir) != expected:
        raise OcriaError(f"{model_dir}: does not match the model the plan was calibrated on "
                         f"(fingerprint {expected}); export the model you calibrated, or calibrate again")

    from llmcompressor import oneshot

    net, proc = load_model(model_dir, dtype="bf16")
    groups = discover_groups(net)
    recipe = build_recipe(plan, groups)  # validates the plan before any work
    calib_pages = select_split(load_pages(Path(pages) if pages else BUNDLED_PAGES).pages, "calibration")[:max_pages]
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        oneshot(model=net, recipe=recipe, dataset=calibration_dataset(proc, calib_pages), data_collator=collate_one,
                num_calibration_samples=len(calib_pages), sequential_targets=["Qwen3_5DecoderLayer"], processor=proc)
        retied = retie_global_scales(net, plan, groups)
        net.save_pretrained(tmp, save_compressed=True)
        save_processor(proc, tmp)
        (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json", exclude_none=True)))
        (tmp / "ocriaquant.json").write_text(json.dumps({
            "plan": plan_doc, "calibration_fingerprint": expected, "retied_fused_units": retied,
            "calibration_pages": [p.name for p in calib_pages], "versions": _versions()}, indent=1))
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
