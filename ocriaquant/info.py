"""`ocriaquant info`: the layer-group table of a model, built on the meta device (no weights read)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .data import load_pages, split_pages
from .errors import OcriaError
from .model import FORMATS, SHAPES, discover_groups, load_config, meta_model
from .model.groups import LayerGroup, decode_bytes, decoder_linear_params, layer_types, unassigned_linears
from .model.load import resolve_model_dir, weights_problem
from .model.mtp import mtp_keys


@dataclass
class ModelInfo:
    source: str
    layer_types: list[str]
    groups: list[LayerGroup]
    unassigned: list[str]
    weights_problem: str | None = None  # a model directory whose weights are missing: what is wrong
    mtp_tensors: int | None = None  # its multi-token-prediction layer's tensors (None: a shape, or no weights)

    @property
    def decoder_params(self) -> int:
        return decoder_linear_params(self.groups)

    def step_bytes(self, fmt: str) -> float:
        return decode_bytes(self.groups, fmt)

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "weights_problem": self.weights_problem,
            "mtp_tensors": self.mtp_tensors,
            "gdn_layers": self.layer_types.count("linear_attention"),
            "attention_layers": self.layer_types.count("full_attention"),
            "decoder_linear_params": self.decoder_params,
            "decode_step_bytes": {f: self.step_bytes(f) for f in FORMATS},
            "groups": [
                {"name": g.name, "kind": g.kind, "members": g.members, "params": g.params, "fused": g.fused,
                 "always_bf16": g.always_bf16, "bytes": {f: g.bytes(f) for f in FORMATS}}
                for g in self.groups
            ],
        }


def model_info(model: str | Path | None = None, shape: str | None = None) -> ModelInfo:
    if shape is not None:
        if shape not in SHAPES:
            raise OcriaError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
        config, source = SHAPES[shape](), f"shape {shape}"
        problem = None  # a named shape has no weights by design
    else:
        config = load_config(model)
        source = str(model) if model else "bundled model"
        problem = weights_problem(resolve_model_dir(model, weights=False))
    net = meta_model(config)
    groups = discover_groups(net)
    mtp = None if shape is not None or problem else len(mtp_keys(resolve_model_dir(model)))
    return ModelInfo(source, layer_types(net), groups, unassigned_linears(net, groups), problem, mtp)


def _fmt_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def render_info(info: ModelInfo, console: Console, by_kind: bool = False) -> None:
    n_gdn = info.layer_types.count("linear_attention")
    n_attn = info.layer_types.count("full_attention")
    console.print(f"[bold]{info.source}[/]: {len(info.layer_types)} decoder layers "
                  f"({n_gdn} GDN, {n_attn} attention), {len(info.groups)} layer groups"
                  + ("; [yellow]its weights are missing[/]" if info.weights_problem else ""))

    table = Table(show_lines=False)
    for col in ("group", "members", "params", "BF16", "FP8", "NVFP4", "note"):
        table.add_column(col, justify="right" if col in ("params", "BF16", "FP8", "NVFP4") else "left")
    if by_kind:
        counts = Counter(g.kind for g in info.groups)
        for kind in dict.fromkeys(g.kind for g in info.groups):
            gs = [g for g in info.groups if g.kind == kind]
            note = "always BF16" if gs[0].always_bf16 else ("fused unit" if gs[0].fused else "")
            table.add_row(f"{kind} ×{counts[kind]}", str(len(gs[0].members)), _fmt_count(sum(g.params for g in gs)),
                          *(_fmt_bytes(sum(g.bytes(f) for g in gs)) for f in FORMATS), note)
    else:
        for g in info.groups:
            members = ", ".join(m.rsplit(".", 1)[-1] for m in g.members) if g.kind != "vision" \
                else f"{len(g.members)} Linear"
            note = "always BF16" if g.always_bf16 else ("fused unit" if g.fused else "")
            table.add_row(g.name, members, _fmt_count(g.params), *(_fmt_bytes(g.bytes(f)) for f in FORMATS), note)
    console.print(table)

    console.print(f"decoder Linear parameters: [bold]{_fmt_count(info.decoder_params)}[/] "
                  f"({info.decoder_params:,})")
    console.print("weight bytes per decode step (decoder + lm_head; vision runs once per page; "
                  "NVFP4 at 4.5 bits/weight; always-BF16 groups stay BF16):")
    for f in FORMATS:
        console.print(f"  all-{f.upper():<6} {_fmt_bytes(info.step_bytes(f))}")
    if info.mtp_tensors:
        console.print(f"multi-token-prediction layer: {info.mtp_tensors} tensors, the drafter of speculative "
                      "decoding (`ocriaquant parse --spec 3`)")
    elif info.mtp_tensors == 0:
        console.print("no multi-token-prediction layer (mtp.*): `--spec` needs one")
    if info.unassigned:
        console.print(f"[yellow]Linear modules in no group: {', '.join(info.unassigned)}[/]")


def weights_warning(info: ModelInfo) -> str | None:
    """What `ocriaquant info` says about a model directory whose weights are missing."""
    if info.weights_problem is None:
        return None
    return (f"{info.source}: {info.weights_problem}. This description comes from config.json alone; "
            "calibrate, search, export, eval, parse and bench need the weights.")


def render_pages(pages_dir: Path, console: Console, skip_bad: bool = False) -> None:
    report = load_pages(pages_dir, skip_bad=skip_bad)
    calib, held = split_pages(report.pages)
    with_ref = sum(p.has_reference for p in report.pages)
    console.print(f"[bold]{pages_dir}[/]: {len(report.pages)} pages ({with_ref} with ground truth), "
                  f"{len(calib)} calibration / {len(held)} held-out"
                  + (f", {len(report.bad)} unreadable skipped" if report.bad else ""))
