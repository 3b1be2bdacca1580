"""`ocriaquant search`: pick a format per layer group, fastest within a parsing-quality tolerance.

1. Space: a YAML policy (recipes/default.yaml) pins or forbids formats by group pattern.
2. Cost: predicted decode-step time per group and format on the target GPU, from a measured
   latency table (benchmarks/bench_kernels.py) where it has the shape, otherwise bytes moved /
   bandwidth (H200 4.8 TB/s, B200 8 TB/s).
3. Solver: the exact Pareto frontier of predicted step time against summed sensitivity
   (calibration's expected KL per token), built group by group with dominated partial plans
   pruned — from all-BF16 to all-NVFP4.
4. Candidates: all-BF16, all-FP8, all-NVFP4 (both targets' numerics) and frontier points
   spread between all-FP8 and all-NVFP4 in predicted time are decoded on held-out pages in
   the target's simulated numerics. The chosen plan is the fastest whose NED increase over
   BF16 has an upper 95% bound within the tolerance.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml

from .artifacts import (DEFAULT_CALIBRATION, DEFAULT_SEARCH, Plan, calibrated_model, input_absmax, load_calibration,
                        save_plan)
from .errors import OcriaError
from .files import write_json_atomic
from .model.groups import BITS_PER_WEIGHT, FORMATS

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
DEFAULT_POLICY = RECIPES / "default.yaml"
BANDWIDTH = {"h200": 4.8e12, "b200": 8.0e12}  # bytes/s


@dataclass(frozen=True)
class SearchOptions:
    target: str = "h200"                  # h200 (NVFP4 weight-only, FP8 W8A8) or b200 (NVFP4 W4A4)
    batch: int = 1                        # serving batch the step time is predicted for
    max_ned_increase: float = 0.01        # tolerance: NED increase over BF16, 95% upper bound
    policy: str | Path | None = None      # search-space YAML (None: recipes/default.yaml)
    latency_table: str | Path | None = None  # measured latencies (None: bytes / bandwidth)
    eval_pages: int = 16                  # held-out pages decoded per candidate
    candidates: int = 4                   # frontier points evaluated besides BF16 / FP8 / NVFP4
    device: str = "cpu"
    dtype: str = "fp32"                   # compute dtype of the simulation
    batch_size: int = 16                  # pages decoded together
    max_new_tokens: int | None = None     # None: 1.25x the longest reference


# ---------------------------------------------------------------------------- policy

@dataclass
class Policy:
    formats: list[str]
    pin: dict[str, str] = field(default_factory=dict)
    forbid: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path | None = None) -> "Policy":
        path = Path(path) if path else DEFAULT_POLICY
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise OcriaError(f"{path}: cannot read policy ({e})") from e
        pol = cls(list(data.get("formats", FORMATS)), dict(data.get("pin") or {}), dict(data.get("forbid") or {}))
        for f in pol.formats + list(pol.pin.values()) + [f for fs in pol.forbid.values() for f in fs]:
            if f not in FORMATS:
                raise OcriaError(f"{path}: unknown format {f!r}; formats are {', '.join(FORMATS)}")
        return pol

    def allowed(self, group_names: list[str], always_bf16: set[str]) -> dict[str, list[str]]:
        """Allowed formats per group. A pattern matching no group is an error that names it."""
        for pattern in list(self.pin) + list(self.forbid):
            if not any(fnmatch.fnmatchcase(g, pattern) for g in group_names):
                raise OcriaError(f"policy names {pattern!r}, which matches no layer group of this model "
                                 f"(groups look like {group_names[1]!r}; see `ocriaquant info`)")
        out = {}
        for g in group_names:
            fmts = list(self.formats)
            for pattern, fmt in self.pin.items():
                if fnmatch.fnmatchcase(g, pattern):
                    fmts = [fmt]
            for pattern, bad in self.forbid.items():
                if fnmatch.fnmatchcase(g, pattern):
                    fmts = [f for f in fmts if f not in bad]
            if g in always_bf16:
                fmts = ["bf16"]
            if not fmts:
                raise OcriaError(f"policy leaves group {g!r} no format")
            out[g] = fmts
        return out


# ---------------------------------------------------------------------------- cost model

@dataclass
class CostModel:
    """Predicted seconds per decode step a group costs in a format, on `target` at `batch`."""

    target: str
    batch: int = 1
    table: dict[tuple[int, int, str, int], float] = field(default_factory=dict)  # (N, K, fmt, batch) -> s
    source: str = "analytical"

    @classmethod
    def load(cls, target: str, batch: int = 1, latency_table: str | Path | None = None) -> "CostModel":
        if target not in BANDWIDTH:
            raise OcriaError(f"unknown target {target!r}; choose h200 or b200")
        cm = cls(target, batch)
        if latency_table:
            path = Path(latency_table)
            try:
                data = json.loads(path.read_text())
                for e in data["entries"]:
                    cm.table[(int(e["n"]), int(e["k"]), e["format"], int(e["batch"]))] = float(e["us"]) * 1e-6
            except (OSError, KeyError, ValueError, TypeError) as e:
                raise OcriaError(f"{path}: not a latency table (expected {{'entries': [{{'n', 'k', 'format', "
                                 f"'batch', 'us'}}]}}): {e}") from e
            cm.source = f"{path} ({data.get('gpu', 'unknown GPU')})"
        return cm

    def member_time(self, n: int, k: int, fmt: str) -> float:
        measured = self.table.get((n, k, fmt, self.batch))
        if measured is not None:
            return measured
        weight_bytes = n * k * BITS_PER_WEIGHT[fmt] / 8
        act_bytes = self.batch * (n + k) * 2
        return (weight_bytes + act_bytes) / BANDWIDTH[self.target]

    def group_time(self, group, fmt: str) -> float:
        fmt = "bf16" if group.always_bf16 else fmt
        ks = {k for _, k in group.shapes}
        if len(group.shapes) > 1 and len(ks) == 1:
            # The runtime runs a fused unit as one GEMV over the stacked weights: use that
            # measurement when the table has it.
            fused = self.table.get((sum(n for n, _ in group.shapes), ks.pop(), fmt, self.batch))
            if fused is not None:
                return fused
        return sum(self.member_time(n, k, fmt) for n, k in group.shapes)


# ---------------------------------------------------------------------------- solver

@dataclass
class FrontierPoint:
    time: float
    damage: float
    plan: dict[str, str]


def pareto_frontier(options: dict[str, list[tuple[str, float, float]]], max_points: int = 20000) -> list[FrontierPoint]:
    """Exact Pareto frontier of (sum time, sum damage) over one choice per group.

    `options`: group -> [(format, time, damage)]. Partial plans are merged group by group and
    any partial plan that another beats on both time and damage is dropped: a dominated
    partial plan can never complete into a non-dominated plan, so the result is exact (unless
    it exceeds `max_points`, where it is thinned evenly in time). Sorted by time, fastest first.
    """
    names = list(options)
    times, damages = np.zeros(1), np.zeros(1)
    back: list[tuple[np.ndarray, np.ndarray]] = []  # per group: (parent index, choice index)
    for g in names:
        opts = options[g]
        t = (times[:, None] + np.array([o[1] for o in opts])[None, :]).ravel()
        d = (damages[:, None] + np.array([o[2] for o in opts])[None, :]).ravel()
        parent = np.repeat(np.arange(times.size), len(opts))
        choice = np.tile(np.arange(len(opts)), times.size)
        order = np.lexsort((d, t))  # by time, then damage
        t, d, parent, choice = t[order], d[order], parent[order], choice[order]
        # keep a point only if its damage is strictly below every faster point's
        best = np.minimum.accumulate(d)
        keep = np.ones(t.size, dtype=bool)
        keep[1:] = d[1:] < best[:-1]
        t, d, parent, choice = t[keep], d[keep], parent[keep], choice[keep]
        if t.size > max_points:
            idx = np.unique(np.linspace(0, t.size - 1, max_points).round().astype(int))
            t, d, parent, choice = t[idx], d[idx], parent[idx], choice[idx]
        times, damages = t, d
        back.append((parent, choice))
    points = []
    for i in range(times.size):
        plan, j = {}, i
        for g, (parent, choice) in zip(reversed(names), reversed(back)):
            plan[g] = options[g][choice[j]][0]
            j = parent[j]
        points.append(FrontierPoint(float(times[i]), float(damages[i]), {g: plan[g] for g in names}))
    return points


def uniform_plan(allowed: dict[str, list[str]], fmt: str) -> dict[str, str]:
    """Every group in `fmt` where the policy allows it, else its first allowed format."""
    return {g: fmt if fmt in fmts else fmts[0] for g, fmts in allowed.items()}


# ---------------------------------------------------------------------------- evaluation and report

@dataclass
class Candidate:
    label: str
    target: str
    plan: dict[str, str]
    predicted_s: float
    damage: float
    ned: list[float] = field(default_factory=list)          # vs ground truth, per page
    ned_vs_bf16: list[float] = field(default_factory=list)  # vs the BF16 model's output
    same_as_bf16: float = 0.0                               # fraction of pages with identical output
    delta: object = None                                    # Interval: NED(candidate) - NED(BF16)

    def summary(self) -> dict:
        from .eval import bootstrap_mean

        ci = bootstrap_mean(self.ned)
        return {"label": self.label, "target": self.target, "predicted_ms": self.predicted_s * 1e3,
                "damage": self.damage, "ned": ci.estimate, "ned_ci": [ci.low, ci.high],
                "ned_vs_bf16": float(np.mean(self.ned_vs_bf16)), "same_as_bf16": self.same_as_bf16,
                "ned_increase": None if self.delta is None else [self.delta.estimate, self.delta.low, self.delta.high],
                "formats": {f: sum(v == f for v in self.plan.values()) for f in FORMATS}}


def _decode(net, proc, pages, groups, plan, target, absmax, max_new_tokens, batch_size):
    from .model.generate import greedy_decode
    from .quant.simulate import plan_units, simulate

    with simulate(net, plan_units(plan, {g: grp.members for g, grp in groups.items()}, target), absmax):
        return greedy_decode(net, proc, pages, batch_size=batch_size, max_new_tokens=max_new_tokens)


def run_search(calib: str | Path | None = None, pages: str | Path | None = None, out: str | Path | None = None,
               options: SearchOptions | None = None, *, console=None, **fields) -> dict:
    """Search the calibration artifact `calib` (default ocriaquant-out/calib) and write plan.json,
    report.json, report.md and pareto.png to `out`; returns the report. Fields of SearchOptions
    may also be given by name (`target="b200"`)."""
    from rich.console import Console

    from .data import load_pages, select_split
    from .eval import ned, paired_bootstrap
    from .model import discover_groups, load_model
    from .model.generate import default_max_new_tokens

    opts = replace(options or SearchOptions(), **fields)
    target, tolerance = opts.target, opts.max_ned_increase
    console = console or Console(stderr=True)
    out = Path(out) if out else DEFAULT_SEARCH
    calib_path = Path(calib) if calib else DEFAULT_CALIBRATION
    calibration = load_calibration(calib_path)
    sens, model_dir = calibration.sensitivity, calibrated_model(calibration, calib_path)
    cost = CostModel.load(target, opts.batch, opts.latency_table)
    pol = Policy.load(opts.policy)

    net, proc = load_model(model_dir, dtype=opts.dtype, device=opts.device)
    groups = {g.name: g for g in discover_groups(net)}
    allowed = pol.allowed(list(groups), {g for g, grp in groups.items() if grp.always_bf16})
    choices = {g: [(f, cost.group_time(groups[g], f), 0.0 if f == "bf16" else sens[target][g][f]) for f in fmts]
               for g, fmts in allowed.items() if groups[g].kind != "vision"}
    frontier = pareto_frontier(choices)

    def total(plan, tgt=target):
        t = sum(cost.group_time(groups[g], f) for g, f in plan.items() if groups[g].kind != "vision")
        d = sum(0.0 if f == "bf16" else sens[tgt][g][f] for g, f in plan.items() if groups[g].kind != "vision")
        return t, d

    pages_dir = Path(pages) if pages else calibration.pages_dir
    held = [p for p in select_split(load_pages(pages_dir).pages, "heldout") if p.has_reference][:opts.eval_pages]
    if not held:
        raise OcriaError(f"{pages_dir}: no held-out pages with ground truth to evaluate candidates on")
    tok = proc.tokenizer
    max_new = opts.max_new_tokens or default_max_new_tokens(tok, held)
    absmax = input_absmax(calibration.stats)

    plans: list[Candidate] = []
    for label, fmt, tgt in (("BF16", "bf16", target), ("all-FP8 (W8A8, both targets)", "fp8", target),
                            ("all-NVFP4 (h200: W4A16)", "nvfp4", "h200"), ("all-NVFP4 (b200: W4A4)", "nvfp4", "b200")):
        plan = uniform_plan(allowed, fmt)
        plans.append(Candidate(label, tgt, plan, *total(plan, tgt)))
    # Frontier points spaced in time between the fastest plan and all-FP8, or, where a measured
    # table makes all-FP8 the fastest (a slow NVFP4 kernel), between it and BF16.
    t_fast = frontier[0].time
    t_fp8 = total(uniform_plan(allowed, "fp8"))[0]
    t_slow = t_fp8 if t_fp8 > t_fast * 1.001 else total(uniform_plan(allowed, "bf16"))[0]
    chosen_idx: list[int] = []
    for goal in np.linspace(t_fast, t_slow, opts.candidates + 2)[1:-1]:
        i = int(np.argmin([abs(p.time - goal) for p in frontier]))
        if i not in chosen_idx:
            chosen_idx.append(i)
    for n, i in enumerate(chosen_idx):
        p = frontier[i]
        plan = {**{g: "bf16" for g in groups if g not in p.plan}, **p.plan}  # vision is outside the search
        plans.append(Candidate(f"frontier-{n + 1}", target, plan, p.time, p.damage))

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("evaluating {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("candidates", total=len(plans))
        base_out = None
        for c in plans:
            bar.update(task, description=c.label)
            preds = _decode(net, proc, held, groups, c.plan, c.target, absmax, max_new, opts.batch_size)
            if base_out is None:
                base_out = preds
            c.ned = [ned(y, p.reference) for y, p in zip(preds, held)]
            c.ned_vs_bf16 = [ned(y, b) for y, b in zip(preds, base_out)]
            c.same_as_bf16 = float(np.mean([y == b for y, b in zip(preds, base_out)]))
            bar.advance(task)
    for c in plans:
        c.delta = paired_bootstrap(plans[0].ned, c.ned)

    fp8 = plans[1]
    ok = [c for c in plans[1:] if c.target == target and c.delta.high <= tolerance]
    chosen = min(ok, key=lambda c: c.predicted_s) if ok else plans[0]
    verdict = (f"{chosen.label} is predicted {fp8.predicted_s / chosen.predicted_s:.2f}x the speed of all-FP8 "
               f"and raises NED by {chosen.delta.estimate:+.4f} (95% CI upper {chosen.delta.high:+.4f}, "
               f"tolerance {tolerance})")
    if chosen is plans[0]:
        verdict = (f"no candidate stays within +{tolerance} NED of BF16 at the 95% upper bound "
                   f"(all-FP8: {fp8.delta.high:+.4f}); BF16 is kept. Raise --max-ned-increase or evaluate more pages.")
    elif chosen.predicted_s >= fp8.predicted_s and t_fp8 <= t_fast * 1.001:
        verdict = (f"no plan is predicted faster than all-FP8 with this cost model ({cost.source}): there, FP8 is "
                   "the fastest format for every group. " + verdict)
    elif chosen.predicted_s >= fp8.predicted_s:
        verdict = ("no plan beats all-FP8 within the tolerance: every faster candidate's NED increase exceeds "
                   f"+{tolerance} at the 95% upper bound. " + verdict)

    out.mkdir(parents=True, exist_ok=True)
    predicted = {"step_ms": chosen.predicted_s * 1e3, "damage_kl_per_token": chosen.damage, "cost_model": cost.source}
    chosen_plan = Plan(groups=chosen.plan, target=target, model_dir=model_dir, calibration=calib_path,
                       model_fingerprint=calibration.model_fingerprint,
                       evidence={"batch": opts.batch, "predicted": predicted, "measured": chosen.summary(),
                                 "tolerance": tolerance})
    report = {"target": target, "batch": opts.batch, "cost_model": cost.source, "verdict": verdict,
              "chosen": chosen.label, "eval_pages": len(held), "frontier_points": len(frontier),
              "frontier": [{"predicted_ms": p.time * 1e3, "damage": p.damage,
                            "formats": {f: sum(v == f for v in p.plan.values()) for f in FORMATS}} for p in frontier],
              "candidates": [c.summary() for c in plans]}
    save_plan(out / "plan.json", chosen_plan)
    write_json_atomic(out / "report.json", report)
    _write_markdown(out / "report.md", report, chosen, groups)
    _plot(out / "pareto.png", plans, chosen, target)
    return report


def _write_markdown(path: Path, report: dict, chosen: Candidate, groups) -> None:
    lines = [f"# ocriaquant search — target {report['target']}, batch {report['batch']}", "",
             f"**Chosen: {report['chosen']}.** {report['verdict'].rstrip('.')}.", "",
             f"Cost model: {report['cost_model']}. Held-out pages evaluated: {report['eval_pages']}.", "",
             "## Evaluated candidates", "",
             "| candidate | numerics | predicted step (ms) | KL/token (est.) | NED vs truth [95% CI] | "
             "ΔNED vs BF16 [95% CI] | NED vs BF16 output | identical to BF16 | BF16/FP8/NVFP4 groups |",
             "| --- | --- | ---: | ---: | --- | --- | ---: | ---: | --- |"]
    for c in report["candidates"]:
        inc = c["ned_increase"]
        f = c["formats"]
        lines.append(f"| {c['label']} | {c['target']} | {c['predicted_ms']:.4f} | {c['damage']:.2e} | "
                     f"{c['ned']:.4f} [{c['ned_ci'][0]:.4f}, {c['ned_ci'][1]:.4f}] | "
                     f"{inc[0]:+.4f} [{inc[1]:+.4f}, {inc[2]:+.4f}] | {c['ned_vs_bf16']:.4f} | "
                     f"{c['same_as_bf16']:.0%} | {f['bf16']}/{f['fp8']}/{f['nvfp4']} |")
    lines += ["", f"## Pareto frontier ({report['frontier_points']} points, predicted)", "",
              "| predicted step (ms) | KL/token (est.) | BF16/FP8/NVFP4 groups |", "| ---: | ---: | --- |"]
    fr = report["frontier"]
    step = max(1, len(fr) // 25)
    for p in fr[::step]:
        f = p["formats"]
        lines.append(f"| {p['predicted_ms']:.4f} | {p['damage']:.2e} | {f['bf16']}/{f['fp8']}/{f['nvfp4']} |")
    lines += ["", "## Chosen plan per layer group", "", "| group | format | members |", "| --- | --- | --- |"]
    for g, fmt in chosen.plan.items():
        lines.append(f"| {g} | {fmt} | {', '.join(m.rsplit('.', 1)[-1] for m in groups[g].members[:4])}"
                     f"{' …' if len(groups[g].members) > 4 else ''} |")
    path.write_text("\n".join(lines) + "\n")


def _plot(path: Path, plans: list[Candidate], chosen: Candidate, target: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in plans:
        s = c.summary()
        ax.errorbar(s["predicted_ms"], s["ned"], yerr=[[s["ned"] - s["ned_ci"][0]], [s["ned_ci"][1] - s["ned"]]],
                    fmt="o", capsize=3, label=f"{c.label} ({c.target})")
    s = chosen.summary()
    ax.plot(s["predicted_ms"], s["ned"], marker="*", markersize=18, color="gold", markeredgecolor="black",
            linestyle="none", label="chosen")
    ax.set_xlabel(f"predicted decode step time on {target} (ms)")
    ax.set_ylabel("held-out NED vs ground truth")
    ax.set_title("ocriaquant search: speed vs measured parsing quality")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
