"""`ocriaquant calibrate`: activation statistics and per-(group, format, target) sensitivity.

The calibration pages run through the model teacher-forced on their ground truth (or, for
a page without one, on the BF16 model's own greedy output). For every quantizable Linear we
record its input statistics (per-channel absmax and mean square, token count) and, for each
way it can be quantized, an estimate of the damage that alone does to the output.

Estimator: Fisher-weighted output error. Quantizing one Linear changes its output by
δy = Q(x)·Q(W)ᵀ − x·Wᵀ on the real calibration activations x (weights and activations in
the exact numerics of the target: FP8 W8A8, NVFP4 W4A16 on h200, W4A4 on b200). To second
order, the KL divergence of the model's next-token distribution grows by ½·δyᵀ F δy, with F
the Fisher information of the log-likelihood w.r.t. that output. We use the empirical
Fisher's diagonal, g² with g = ∂(−log p(target))/∂y from one backward pass, and sum
½·Σ g²·δy² over every token and channel (tokens of the prompt and image included: their
gradient carries their influence on the targets). Members of a fused unit add up and share
their NVFP4 global scale. Result: expected KL increase in nats per target token.

Why this and not the alternatives: measuring the KL with each group quantized alone costs
one forward pass per (group, format, target), 99 passes for the bundled model and 300+ for
a 4B; this costs one forward and one backward in all. A weight-only proxy (‖ΔW‖ or
Hessian-trace bits) misses the activation quantization that dominates W8A8 / W4A4 damage,
and an unweighted ‖δy‖² ranks layers by activation scale rather than by how much the
output depends on them (the lm_head and the last MLP are not alike).

Validation (benchmarks/validate_sensitivity.py; results in benchmarks/results/): on the bundled
model, the estimate from 32 calibration pages ranks the 99 (group, kind) pairs — 33 groups ×
FP8 W8A8 / NVFP4 W4A16 / NVFP4 W4A4 — against the KL measured on 12 held-out pages
(2,235 target tokens) with each group alone quantized at Spearman 0.857 (FP8 0.66,
W4A16 0.82, W4A4 0.76) for the model as bundled now (held-out NED 0.0015; 0.901 for its
earlier, less trained state). The damage it ranks is now tiny (KL ~1e-8–1e-6 per token), and
FP8's damages are the closest together, so its within-FP8 ranking is the noisiest.

The artifact is a directory: meta.json (fingerprint of model files, pages and settings; the model
and page folders relative to the artifact, so it moves together with them), stats.safetensors,
sensitivity.json (its layout, reading and writing: artifacts.py). It is
written to a temporary directory and renamed into place; a rerun with the same fingerprint
does nothing; an interrupted run leaves OUT.partial/ (accumulators after each batch) and a
rerun continues from it.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from safetensors.torch import load_file

from .artifacts import DEFAULT_CALIBRATION, calibration_fingerprint, stored_fingerprint, write_calibration
from .data import BUNDLED_PAGES, Page, load_pages, select_split
from .errors import OcriaError
from .files import write_json_atomic, write_safetensors_atomic
from .model import discover_groups, load_model
from .model.gdn_train import differentiable
from .model.generate import greedy_decode
from .model.load import resolve_model_dir
from .model.processor import chat_text
from .quant import fp8, nvfp4
from .quant.simulate import KINDS, TARGETS, kind_for, quantize_input

FORMATS_Q = ("fp8", "nvfp4")


@dataclass(frozen=True)
class CalibrateOptions:
    max_pages: int | None = 32     # None: every page of the split
    split: str = "calibration"     # calibration (hash split), heldout or all
    batch_size: int = 4            # pages per forward/backward pass
    device: str = "cpu"
    dtype: str = "fp32"
    skip_bad: bool = False         # skip unreadable pages instead of failing
    max_new_tokens: int = 1024     # length of the model's own targets for pages without ground truth


@dataclass
class CalibResult:
    out: Path
    reused: bool
    pages: int
    seconds: float


class _Collector:
    """Forward/backward hooks that accumulate statistics and sensitivities for each Linear."""

    def __init__(self, model, groups, acc: dict[str, torch.Tensor]):
        self.model = model
        self.acc = acc
        self.mask: torch.Tensor | None = None  # [B, T] tokens that count (not padding)
        self.hooks = []
        # Quantized weights kept compact (E4M3 / packed E2M1 + scales, ~1.6 bytes a parameter for
        # both) and dequantized per batch: holding dequantized copies of every Linear in two
        # formats would cost 2x the model's memory.
        self.qweights: dict[tuple[str, str], tuple] = {}
        for g in groups:
            if g.always_bf16:
                continue
            mods = [model.get_submodule(m) for m in g.members]
            gs = nvfp4.global_scale(*(m.weight for m in mods))
            for name, mod in zip(g.members, mods):
                w = mod.weight.detach()
                self.qweights[(name, "fp8")] = fp8.quantize_weight(w, name)
                self.qweights[(name, "nvfp4")] = nvfp4.quantize_weight(w, gs, name)
                k, o = mod.in_features, mod.out_features
                for key, shape in ((".absmax", (k,)), (".sqsum", (k,)), (".fisher", (o,)), (".count", ())):
                    acc.setdefault(name + key, torch.zeros(shape, dtype=torch.float64))
                for kind in KINDS:
                    acc.setdefault(f"{name}.sens.{kind}", torch.zeros((), dtype=torch.float64))
                self.hooks.append(mod.register_forward_hook(self._forward_hook(name)))

    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            x = inputs[0].detach()
            if self.mask is not None and x.shape[:2] == self.mask.shape:
                m = self.mask
            else:  # lm_head sees only the selected target positions
                m = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
            xf = x[m].double()
            acc = self.acc
            acc[name + ".absmax"] = torch.maximum(acc[name + ".absmax"], xf.abs().amax(0).cpu())
            acc[name + ".sqsum"] += (xf * xf).sum(0).cpu()
            acc[name + ".count"] += float(xf.shape[0])
            if not output.requires_grad:
                return
            in_absmax = acc[name + ".absmax"].max().to(x.dtype)

            def grad_hook(g, x=x, m=m):
                y = F.linear(x, module.weight, module.bias)  # recomputed: outputs are not kept for every Linear
                g2 = (g.detach().double() ** 2)[m]
                acc[name + ".fisher"] += g2.sum(0).cpu()
                w_fp8 = fp8.dequantize(*self.qweights[(name, "fp8")], x.dtype)
                w_fp4 = nvfp4.dequantize(*self.qweights[(name, "nvfp4")], x.dtype)
                for kind in KINDS:
                    gs = nvfp4.global_scale_from_absmax(in_absmax) if kind == "w4a4" else None
                    xq = quantize_input(x, kind, gs)
                    dy = (F.linear(xq, w_fp8 if kind == "fp8" else w_fp4) - y)[m].double()
                    acc[f"{name}.sens.{kind}"] += 0.5 * (g2 * dy * dy).sum().cpu()

            output.register_hook(grad_hook)

        return hook

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def teacher_forcing_batch(processor, pages: list[Page], targets: list[str], device) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Teacher-forcing inputs: prompt (with image) + target + <|im_end|>, right-padded.
    Returns (model inputs, [B, T] non-padding mask, [N, 2] (row, position) of target tokens)."""
    tok = processor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rows, mm_rows, pix, grids, spans = [], [], [], [], []
    for page, target in zip(pages, targets):
        enc = processor(images=[page.image], text=[chat_text(processor, page.prompt)], return_tensors="pt")
        tgt = torch.tensor(tok(target, add_special_tokens=False)["input_ids"] + [end])
        ids = torch.cat([enc["input_ids"][0], tgt])
        rows.append(ids)
        mm_rows.append(torch.cat([enc["mm_token_type_ids"][0], torch.zeros_like(tgt)]))
        pix.append(enc["pixel_values"])
        grids.append(enc["image_grid_thw"])
        spans.append((enc["input_ids"].shape[1], ids.numel()))
    length = max(r.numel() for r in rows)
    pad = tok.pad_token_id or 0
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    mm = torch.zeros_like(ids)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (r, t) in enumerate(zip(rows, mm_rows)):
        ids[i, : r.numel()], mm[i, : t.numel()], mask[i, : r.numel()] = r, t, True
    tpos = torch.tensor([(i, p) for i, (s, e) in enumerate(spans) for p in range(s, e)])
    inputs = {"input_ids": ids, "attention_mask": mask.long(), "mm_token_type_ids": mm,
              "pixel_values": torch.cat(pix), "image_grid_thw": torch.cat(grids)}
    return {k: v.to(device) for k, v in inputs.items()}, mask.to(device), tpos.to(device)


def target_logits(net, inputs: dict, tpos: torch.Tensor) -> torch.Tensor:
    """Logits predicting each target token of a teacher-forcing batch: position p - 1 predicts
    token p, so the 248k-wide head runs on target positions only."""
    hidden = net.model(**inputs, use_cache=False).last_hidden_state  # no cache: GDN's differentiable path
    return net.lm_head(hidden[tpos[:, 0], tpos[:, 1] - 1])


def calibrate(model: str | Path | None = None, pages: str | Path | None = None, out: str | Path | None = None,
              options: CalibrateOptions | None = None, *, console: Console | None = None,
              stop_after_batches: int | None = None, **fields) -> CalibResult:
    """Run calibration, or reuse/resume an existing artifact. Fields of CalibrateOptions may
    also be given by name (`max_pages=8`). `stop_after_batches` exists for the resume test: it
    stops as a crash would, leaving OUT.partial/ behind."""
    opts = replace(options or CalibrateOptions(), **fields)
    console = console or Console(stderr=True)
    t0 = time.time()
    model_dir = resolve_model_dir(model)
    pages_dir = Path(pages) if pages else BUNDLED_PAGES
    out = Path(out) if out else DEFAULT_CALIBRATION
    chosen = select_split(load_pages(pages_dir, skip_bad=opts.skip_bad).pages, opts.split)
    if opts.max_pages:
        chosen = chosen[:opts.max_pages]
    if not chosen:
        raise OcriaError(f"{pages_dir}: no {opts.split} pages to calibrate on")
    own_targets = any(not p.has_reference for p in chosen)
    fingerprint = calibration_fingerprint(model_dir, chosen, {
        "batch_size": opts.batch_size, "dtype": opts.dtype, "device": opts.device,
        "max_new_tokens": opts.max_new_tokens if own_targets else None})
    if stored_fingerprint(out) == fingerprint:
        console.print(f"{out}: up to date (same model, pages and settings); nothing to do")
        return CalibResult(out, True, len(chosen), time.time() - t0)

    partial = out.with_name(out.name + ".partial")
    acc: dict[str, torch.Tensor] = {}
    done = 0
    progress_path = partial / "progress.json"
    if progress_path.exists():
        prog = json.loads(progress_path.read_text())
        if prog.get("fingerprint") == fingerprint:
            acc = load_file(str(partial / "state.safetensors"))
            done = prog["done_pages"]
            console.print(f"resuming {partial}: {done} of {len(chosen)} pages already done")
        else:
            shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)

    net, proc = load_model(model_dir, dtype=opts.dtype, device=opts.device)
    net.requires_grad_(False)
    groups = discover_groups(net)

    # Targets: ground truth, or the model's own greedy output where there is none.
    need = [p for p in chosen if not p.has_reference]
    own = {}
    if need:
        own = dict(zip((p.name for p in need), greedy_decode(net, proc, need, max_new_tokens=opts.max_new_tokens)))
    targets = [p.reference if p.has_reference else own[p.name] for p in chosen]

    acc.setdefault("_target_tokens", torch.zeros((), dtype=torch.float64))
    col = _Collector(net, groups, acc)
    embed = net.get_input_embeddings()
    # Gradients are needed only w.r.t. activations: start the graph at the embeddings.
    grad_hook = embed.register_forward_hook(lambda m, i, o: o.requires_grad_(True))
    batches_run = 0
    try:
        with differentiable(opts.device), \
                Progress(TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(), TextColumn("pages"),
                         TimeElapsedColumn(), console=console, transient=True,
                         # what the libraries print goes where logs.quiet sends it, not above the bar
                         redirect_stdout=False, redirect_stderr=False) as bar:
            task = bar.add_task("pages", total=len(chosen), completed=done)
            bs = opts.batch_size
            while done < len(chosen):
                if stop_after_batches is not None and batches_run >= stop_after_batches:
                    return CalibResult(out, False, done, time.time() - t0)
                chunk, tchunk = chosen[done: done + bs], targets[done: done + bs]
                try:
                    inputs, mask, tpos = teacher_forcing_batch(proc, chunk, tchunk, opts.device)
                    col.mask = mask
                    logits = target_logits(net, inputs, tpos)
                    loss = F.cross_entropy(logits.float(), inputs["input_ids"][tpos[:, 0], tpos[:, 1]],
                                           reduction="sum")
                    loss.backward()
                    tokens = float(tpos.shape[0])
                except torch.OutOfMemoryError:
                    tokens = None
                inputs = mask = tpos = logits = loss = None
                if tokens is None:  # fewer pages a pass, the statistics of the pages done: as last saved, or none
                    acc.update(load_file(str(partial / "state.safetensors")) if done else
                               {k: torch.zeros_like(v) for k, v in acc.items()})
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                    if bs == 1:
                        raise OcriaError(f"{chunk[0].name}: one page does not fit in the {opts.device} memory for "
                                         f"calibration in {opts.dtype}; use smaller pages (the processor's "
                                         "max_pixels) or a device with more memory") from None
                    bs = max(1, bs // 2)
                    console.print(f"[yellow]out of memory at {len(chunk)} pages a pass; {bs} from here on[/]")
                    continue
                acc["_target_tokens"] += tokens
                done += len(chunk)
                write_safetensors_atomic(partial / "state.safetensors", acc)
                write_json_atomic(progress_path, {"fingerprint": fingerprint, "done_pages": done})
                batches_run += 1
                bar.update(task, completed=done)
    finally:
        col.remove()
        grad_hook.remove()

    _write_artifact(out, acc, groups, fingerprint, model_dir, pages_dir, len(chosen))
    shutil.rmtree(partial, ignore_errors=True)
    return CalibResult(out, False, len(chosen), time.time() - t0)


def sensitivities(acc: dict[str, torch.Tensor], groups) -> dict[str, dict[str, dict[str, float]]]:
    """{target: {group: {format: expected KL increase, nats per target token}}}"""
    n = float(acc["_target_tokens"])
    result: dict[str, dict[str, dict[str, float]]] = {t: {} for t in TARGETS}
    for g in groups:
        if g.always_bf16:
            continue
        for t in TARGETS:
            result[t][g.name] = {
                fmt: sum(float(acc[f"{m}.sens.{kind_for(fmt, t)}"]) for m in g.members) / n for fmt in FORMATS_Q
            }
    return result


def _write_artifact(out: Path, acc, groups, fingerprint, model_dir: Path, pages_dir: Path, n_pages: int) -> None:
    stats = {}
    for g in groups:
        if g.always_bf16:
            continue
        for m in g.members:
            cnt = float(acc[m + ".count"])
            stats[m + ".act_absmax"] = acc[m + ".absmax"].float()
            stats[m + ".act_meansq"] = (acc[m + ".sqsum"] / max(cnt, 1.0)).float()
            stats[m + ".fisher"] = (acc[m + ".fisher"] / max(cnt, 1.0)).float()
            stats[m + ".tokens"] = torch.tensor([cnt])
    meta = {"fingerprint": fingerprint, "pages": n_pages, "target_tokens": float(acc["_target_tokens"]),
            "estimator": "fisher-weighted output error (see ocriaquant/calibrate.py)",
            "groups": [{"name": g.name, "kind": g.kind, "members": g.members, "always_bf16": g.always_bf16}
                       for g in groups]}
    write_calibration(out, meta, sensitivities(acc, groups), stats, model_dir=model_dir, pages_dir=pages_dir)
