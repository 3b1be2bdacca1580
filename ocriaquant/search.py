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
5. Peers: the recipes the field publishes for Qwen3.5 (recipes/peers/*.yaml, see peers.py)
   are mapped onto the model's groups and evaluated beside ours — same numerics, same pages,
   same cost model — and the report says where each sits against our frontier and whether
   the chosen plan dominates it. They are compared, never chosen.
"""

from __future__ import annotations

import fnmatch
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml

from .artifacts import (DEFAULT_CALIBRATION, DEFAULT_SEARCH, Plan, calibrated_model, input_absmax, load_calibration,
                        save_plan)
from .errors import OcriaError
from .files import write_json_atomic
from .model.groups import BITS_PER_WEIGHT, FORMATS
from .peers import PeerPlan, select as select_peers

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
    peers: str = "all"                    # published recipes evaluated beside ours: none, all or NAME,NAME


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

ROLES = ("bf16", "uniform", "ours", "peer")  # BF16, all-FP8 / all-NVFP4, our frontier points, published recipes


def format_counts(plan: dict[str, str]) -> dict[str, int]:
    """Groups per format over the decoder and lm_head; the vision tower (always BF16, outside
    the search) is left out, so every table of the report counts the same groups."""
    return {f: sum(v == f for g, v in plan.items() if g != "vision") for f in FORMATS}


def _counts_text(f: dict[str, int]) -> str:
    return f"{f['bf16']}/{f['fp8']}/{f['nvfp4']}"


@dataclass
class Candidate:
    label: str
    target: str
    plan: dict[str, str]
    predicted_s: float
    damage: float
    role: str = "ours"                                      # one of ROLES
    frontier_index: int | None = None                       # its row in the frontier (our candidates)
    ned: list[float] = field(default_factory=list)          # vs ground truth, per page
    ned_vs_bf16: list[float] = field(default_factory=list)  # vs the BF16 model's output
    same_as_bf16: float = 0.0                               # fraction of pages with identical output
    delta: object = None                                    # Interval: NED(candidate) - NED(BF16)
    decoded_as: str | None = None                           # an earlier candidate with the same numerics
    decode_s: float = 0.0                                   # wall time of its held-out decode (0: shared); report only

    def summary(self) -> dict:
        from .eval import bootstrap_mean

        ci = bootstrap_mean(self.ned)
        return {"label": self.label, "role": self.role, "target": self.target, "predicted_ms": self.predicted_s * 1e3,
                "damage": self.damage, "ned": ci.estimate, "ned_ci": [ci.low, ci.high],
                "ned_vs_bf16": float(np.mean(self.ned_vs_bf16)), "same_as_bf16": self.same_as_bf16,
                "ned_increase": None if self.delta is None else [self.delta.estimate, self.delta.low, self.delta.high],
                "formats": format_counts(self.plan), "decoded_as": self.decoded_as}


def _decode(net, proc, pages, groups, plan, target, absmax, max_new_tokens, batch_size):
    from .model.generate import greedy_decode
    from .quant.simulate import plan_units, simulate

    with simulate(net, plan_units(plan, {g: grp.members for g, grp in groups.items()}, target), absmax):
        return greedy_decode(net, proc, pages, batch_size=batch_size, max_new_tokens=max_new_tokens)


def _numerics_key(c: Candidate) -> tuple:
    """Candidates with equal keys simulate the same model: FP8 is W8A8 on both targets, and only
    NVFP4 differs between them."""
    quantized = tuple(sorted((g, f) for g, f in c.plan.items() if f != "bf16"))
    return (c.target if any(f == "nvfp4" for _, f in quantized) else "any", quantized)


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
    peer_recipes = select_peers(opts.peers)  # a bad name or recipe fails before any decoding

    net, proc = load_model(model_dir, dtype=opts.dtype, device=opts.device)
    groups = {g.name: g for g in discover_groups(net)}
    allowed = pol.allowed(list(groups), {g for g, grp in groups.items() if grp.always_bf16})
    choices = {g: [(f, cost.group_time(groups[g], f), 0.0 if f == "bf16" else sens[target][g][f]) for f in fmts]
               for g, fmts in allowed.items() if groups[g].kind != "vision"}
    frontier = pareto_frontier(choices)
    mapped = [r.map(list(groups.values())) for r in peer_recipes]

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
        plans.append(Candidate(label, tgt, plan, *total(plan, tgt), role="bf16" if fmt == "bf16" else "uniform"))
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
        plans.append(Candidate(f"frontier-{n + 1}", target, plan, p.time, p.damage, frontier_index=i))
    for m in mapped:
        plans.append(Candidate(f"peer {m.recipe.name}", target, m.plan, *total(m.plan), role="peer"))

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    decoded: dict[tuple, tuple[str, list[str]]] = {}  # numerics -> (first label, outputs): decode each model once
    with Progress(TextColumn("evaluating {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("candidates", total=len(plans))
        base_out = None
        for c in plans:
            bar.update(task, description=c.label)
            key = _numerics_key(c)
            if key in decoded:
                c.decoded_as, preds = decoded[key]
            else:
                t0 = time.perf_counter()
                preds = _decode(net, proc, held, groups, c.plan, c.target, absmax, max_new, opts.batch_size)
                c.decode_s = time.perf_counter() - t0
                decoded[key] = (c.label, preds)
            if base_out is None:
                base_out = preds
            c.ned = [ned(y, p.reference) for y, p in zip(preds, held)]
            c.ned_vs_bf16 = [ned(y, b) for y, b in zip(preds, base_out)]
            c.same_as_bf16 = float(np.mean([y == b for y, b in zip(preds, base_out)]))
            bar.advance(task)
    for c in plans:
        c.delta = paired_bootstrap(plans[0].ned, c.ned)

    bf16, fp8 = plans[0], plans[1]
    ours = [c for c in plans if c.role != "peer" and c.target == target]
    ok = [c for c in ours[1:] if c.delta.high <= tolerance]
    chosen = min(ok, key=lambda c: c.predicted_s) if ok else bf16
    if chosen is bf16:
        verdict = (f"no candidate of ours stays within +{tolerance} NED of BF16 at the 95% upper bound "
                   f"(all-FP8: {fp8.delta.high:+.4f}), so BF16 is kept. Raise --max-ned-increase or evaluate more "
                   "pages.")
    else:
        speed = f"predicted {bf16.predicted_s / chosen.predicted_s:.2f}x the speed of BF16"
        if chosen is not fp8:
            speed += f" and {fp8.predicted_s / chosen.predicted_s:.2f}x all-FP8"
        verdict = (f"{speed}; NED {chosen.delta.estimate:+.4f} over BF16 (95% CI upper {chosen.delta.high:+.4f}, "
                   f"tolerance {tolerance})")
        if chosen.predicted_s >= fp8.predicted_s and t_fp8 <= t_fast * 1.001:
            verdict += (f". No plan is predicted faster than all-FP8 with this cost model ({cost.source}): there, "
                        "FP8 is the fastest format for every group")
        elif chosen.predicted_s >= fp8.predicted_s:
            verdict += (". No plan beats all-FP8 within the tolerance: every faster candidate's NED increase "
                        f"exceeds +{tolerance} at the 95% upper bound")
        verdict += "."

    peer_reports = [_peer_report(m, c, chosen, ours, bf16, frontier, allowed, tolerance, paired_bootstrap)
                    for m, c in zip(mapped, [c for c in plans if c.role == "peer"])]

    out.mkdir(parents=True, exist_ok=True)
    predicted = {"step_ms": chosen.predicted_s * 1e3, "damage_kl_per_token": chosen.damage, "cost_model": cost.source}
    chosen_plan = Plan(groups=chosen.plan, target=target, model_dir=model_dir, calibration=calib_path,
                       model_fingerprint=calibration.model_fingerprint,
                       evidence={"batch": opts.batch, "predicted": predicted, "measured": chosen.summary(),
                                 "tolerance": tolerance})
    # frontier rows whose plan was evaluated: our frontier points, and any other candidate that lies on it
    on_frontier = {tuple(sorted(p.plan.items())): i for i, p in enumerate(frontier)}
    evaluated_as: dict[int, list[str]] = {}
    for c in plans:
        i = c.frontier_index
        if i is None and c.target == target:
            i = on_frontier.get(tuple(sorted((g, f) for g, f in c.plan.items() if g != "vision")))
        if i is not None:
            evaluated_as.setdefault(i, []).append(c.label)
    report = {"target": target, "batch": opts.batch, "cost_model": cost.source, "tolerance": tolerance,
              "verdict": verdict, "chosen": chosen.label, "eval_pages": len(held),
              "eval_page_names": [p.name for p in held], "frontier_points": len(frontier),
              "frontier": [{"predicted_ms": p.time * 1e3, "damage": p.damage, "formats": format_counts(p.plan),
                            **({"evaluated_as": evaluated_as[i]} if i in evaluated_as else {})}
                           for i, p in enumerate(frontier)],
              "candidates": [{**c.summary(), "decode_s": round(c.decode_s, 2)} for c in plans],
              "decode_s": {"all": round(sum(c.decode_s for c in plans), 1),
                           "peers": round(sum(c.decode_s for c in plans if c.role == "peer"), 1)},
              "peers": peer_reports,
              "peers_dominated_by_chosen": [r["name"] for r in peer_reports if r["chosen_dominates"]]}
    save_plan(out / "plan.json", chosen_plan)
    write_json_atomic(out / "report.json", report)
    _write_markdown(out / "report.md", report, chosen, groups)
    _plot(out / "pareto.png", plans, chosen, frontier, target, tolerance)
    return report


# ---------------------------------------------------------------------------- peers against ours

def _dominates(a: Candidate, b: Candidate) -> bool:
    """`a` dominates `b`: predicted no slower and mean held-out NED no worse, one of them strictly."""
    eps = 1e-9 * max(a.predicted_s, b.predicted_s)
    na, nb = float(np.mean(a.ned)), float(np.mean(b.ned))
    no_worse = a.predicted_s <= b.predicted_s + eps and na <= nb + 1e-12
    return no_worse and (a.predicted_s < b.predicted_s - eps or na < nb - 1e-12)


def _frontier_position(c: Candidate, frontier: list[FrontierPoint], outside: int) -> dict:
    """Where a plan's predicted (step time, KL) sits against our predicted frontier."""
    et, ed = 1e-9 * c.predicted_s, 1e-9 * c.damage + 1e-30
    at_speed = [p for p in frontier if p.time <= c.predicted_s + et]
    at_kl = [p for p in frontier if p.damage <= c.damage + ed]
    best = min(at_speed, key=lambda p: p.damage) if at_speed else None
    fastest = min(at_kl, key=lambda p: p.time) if at_kl else None
    below = best is not None and (best.damage < c.damage - ed
                                  or (best.damage <= c.damage + ed and best.time < c.predicted_s - et))
    on = not below and any(abs(p.time - c.predicted_s) <= et and abs(p.damage - c.damage) <= ed for p in frontier)
    pos = {"position": "dominated" if below else "on" if on else "beyond", "outside_policy_groups": outside,
           "kl_at_same_step": None if best is None else best.damage,
           "step_ms_at_same_kl": None if fastest is None else fastest.time * 1e3}
    if below:
        parts = []
        if best is not None and c.damage > 0:
            parts.append(f"at its step our frontier predicts {best.damage / c.damage:.0%} of its KL")
        if fastest is not None:
            parts.append(f"at its KL, {c.predicted_s / fastest.time:.2f}x its speed")
        pos["text"] = "dominated: " + "; ".join(parts) if parts else "dominated"
    elif on:
        pos["text"] = "on our frontier"
    else:
        why = f" ({outside} groups in formats this policy forbids)" if outside else ""
        pos["text"] = f"not dominated{why}"
    return pos


def _peer_report(m: PeerPlan, c: Candidate, chosen: Candidate, ours: list[Candidate], bf16: Candidate,
                 frontier: list[FrontierPoint], allowed: dict[str, list[str]], tolerance: float,
                 paired_bootstrap) -> dict:
    outside = sum(1 for g, f in m.plan.items() if g != "vision" and f not in allowed.get(g, [f]))
    diff = paired_bootstrap(c.ned, chosen.ned)  # NED(chosen) - NED(peer), same pages
    s = c.summary()
    return {"name": m.recipe.name, "title": m.recipe.title, "source": m.recipe.source, "note": m.recipe.note,
            "label": c.label, "rules": [r.describe() for r in m.recipe.rules], "default": m.recipe.default,
            "unmatched_rules": list(m.unmatched), "formats": s["formats"], "mapping": _kind_map(m.plan),
            "predicted_ms": s["predicted_ms"], "speed_vs_bf16": bf16.predicted_s / c.predicted_s,
            "damage": c.damage, "ned": s["ned"], "ned_ci": s["ned_ci"], "ned_increase": s["ned_increase"],
            "within_tolerance": c.delta.high <= tolerance,
            "frontier": _frontier_position(c, frontier, outside),
            "chosen": chosen.label, "chosen_dominates": chosen is not c and _dominates(chosen, c),
            "chosen_speed_vs_peer": c.predicted_s / chosen.predicted_s,
            "chosen_minus_peer_ned": [diff.estimate, diff.low, diff.high],
            "dominated_by": [o.label for o in ours if _dominates(o, c)]}


def _ranges(idx: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(idx):
        if start is None:
            start = x
        if i + 1 == len(idx) or idx[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


def _kind_map(plan: dict[str, str]) -> dict[str, str]:
    """Kind -> the formats a plan gives its groups, with layer ranges where they differ."""
    from .model.groups import GROUP_KINDS

    by_kind: dict[str, dict[str, list[int]]] = {}
    for g, f in plan.items():
        kind = g.rsplit(".", 1)[-1] if g.startswith("layers.") else g
        layer = int(g.split(".")[1]) if g.startswith("layers.") else -1
        by_kind.setdefault(kind, {}).setdefault(f, []).append(layer)
    out = {}
    for kind in [k for k in GROUP_KINDS if k in by_kind]:
        fmts = by_kind[kind]
        if len(fmts) == 1:
            out[kind] = next(iter(fmts))
        else:
            out[kind] = "; ".join(f"{f} {_ranges(sorted(ls))}" for f, ls in sorted(fmts.items(), key=lambda x: x[1][0]))
    return out


# ---------------------------------------------------------------------------- report.md and pareto.png

def _ci(x: list[float], signed: bool = False) -> str:
    f = "{:+.4f}" if signed else "{:.4f}"
    return f"{f.format(x[0])} [{f.format(x[1])}, {f.format(x[2])}]"


def _write_markdown(path: Path, report: dict, chosen: Candidate, groups) -> None:
    tol = report["tolerance"]
    lines = [f"# ocriaquant search — target {report['target']}, batch {report['batch']}", "",
             f"**Chosen: {report['chosen']}** — {report['verdict']}", "",
             f"Cost model: {report['cost_model']} (predicted decode-step time; the same for every row). "
             f"Held-out pages: {report['eval_pages']}, the same for every row. "
             f"Tolerance: NED increase over BF16 ≤ +{tol} at the 95% upper bound.", "",
             "Groups are counted over the decoder and lm_head; the vision tower is always BF16 and not counted. "
             f"Decoding the held-out pages took {report['decode_s']['all']:.0f} s"
             + (f" ({report['decode_s']['peers']:.0f} s of it for the published recipes)." if report["peers"] else "."),
             "",
             "## Evaluated candidates", "",
             "| candidate | numerics | predicted step (ms) | KL/token (est.) | NED vs truth [95% CI] | "
             "ΔNED vs BF16 [95% CI] | NED vs BF16 output | identical to BF16 | BF16/FP8/NVFP4 groups |",
             "| --- | --- | ---: | ---: | --- | --- | ---: | ---: | --- |"]
    for c in report["candidates"]:
        star = " ★" if c["label"] == report["chosen"] else ""
        lines.append(f"| {c['label']}{star} | {c['target']} | {c['predicted_ms']:.4f} | {c['damage']:.2e} | "
                     f"{c['ned']:.4f} [{c['ned_ci'][0]:.4f}, {c['ned_ci'][1]:.4f}] | {_ci(c['ned_increase'], True)} | "
                     f"{c['ned_vs_bf16']:.4f} | {c['same_as_bf16']:.0%} | {_counts_text(c['formats'])} |")
    shared = [c for c in report["candidates"] if c.get("decoded_as")]
    if shared:
        lines += ["", "Same simulated model, decoded once: " +
                  "; ".join(f"{c['label']} = {c['decoded_as']}" for c in shared) + "."]

    peers = report["peers"]
    lines += ["", "## Published recipes beside ours", ""]
    if not peers:
        lines += ["None evaluated (`--peers none`)."]
    else:
        lines += [f"The layouts the field publishes for Qwen3.5 (recipes/peers/), mapped onto this model's layer "
                  f"groups and evaluated exactly like our candidates: {report['target']} numerics, the same "
                  f"{report['eval_pages']} held-out pages, the same cost model. They are compared, never chosen. "
                  "*Dominates* means predicted no slower and mean NED no worse, one of them strictly.", "",
                  "| recipe | BF16/FP8/NVFP4 groups | predicted step (ms) | speed vs BF16 | NED vs truth [95% CI] | "
                  "ΔNED vs BF16 [95% CI] | within tolerance | against our frontier (predicted KL) | "
                  "against the chosen plan (measured) |",
                  "| --- | --- | ---: | ---: | --- | --- | --- | --- | --- |"]
        for r in peers:
            ned_ci = [r["ned"], *r["ned_ci"]]
            d = r["chosen_minus_peer_ned"]
            speed = r["chosen_speed_vs_peer"]
            if r["chosen_dominates"]:
                vs = f"dominated: ours {speed:.2f}x its speed, NED {_ci(d, True)}"
            elif speed >= 1:
                vs = f"not dominated: ours {speed:.2f}x its speed but NED {_ci(d, True)}"
            else:
                vs = f"not dominated: it is {1 / speed:.2f}x our speed, NED {_ci(d, True)}"
            lines.append(f"| {r['name']} | {_counts_text(r['formats'])} | {r['predicted_ms']:.4f} | "
                         f"{r['speed_vs_bf16']:.2f}x | {_ci(ned_ci)} | {_ci(r['ned_increase'], True)} | "
                         f"{'yes' if r['within_tolerance'] else 'no'} | {r['frontier']['text']} | {vs} |")
        dom = report["peers_dominated_by_chosen"]
        rest = [r["name"] for r in peers if r["name"] not in dom]
        lines += ["", f"Last column: the chosen plan ({report['chosen']}) against the recipe; NED is ours minus "
                      "the recipe's, paired over the same pages (negative: ours parses better)."]
        if report["chosen"] == "BF16":
            lines += ["", "No plan of ours stayed within the tolerance, so BF16 is kept; recipes within it are "
                          "marked above."]
        else:
            lines += ["", f"**{report['chosen']} dominates {len(dom)} of {len(peers)} published recipes"
                          f"{': ' + ', '.join(dom) if dom else ''}.**"
                          + (f" It does not dominate {', '.join(rest)}." if rest else "")]
        for r in peers:
            if r["dominated_by"] and not r["chosen_dominates"]:
                lines.append(f"- {r['name']} is dominated by {', '.join(r['dominated_by'])} of ours.")
        lines += ["", "### How each recipe maps onto this model's layer groups", "",
                  "| group kind | " + " | ".join(r["name"] for r in peers) + " |",
                  "| --- |" + " --- |" * len(peers)]
        kinds = list(dict.fromkeys(k for r in peers for k in r["mapping"]))
        for k in kinds:
            lines.append(f"| {k} | " + " | ".join(r["mapping"].get(k, "—") for r in peers) + " |")
        lines += [""]
        for r in peers:
            lines.append(f"- **{r['name']}** — {r['title']}. Source: {r['source']}."
                         + (f" {r['note']}." if r["note"] else "")
                         + f" Rules (first match wins): {'; '.join(f'`{x}`' for x in r['rules']) or 'none'}; "
                           f"default {r['default']}.")
            for u in r["unmatched_rules"]:
                lines.append(f"  - Not applied: {u}.")

    fr = report["frontier"]
    lines += ["", f"## Pareto frontier ({report['frontier_points']} points, predicted)", "",
              "Every evaluated point on the frontier is listed (evaluated as), with others spread between them.", "",
              "| predicted step (ms) | KL/token (est.) | BF16/FP8/NVFP4 groups | evaluated as |",
              "| ---: | ---: | --- | --- |"]
    step = max(1, len(fr) // 25)
    rows = sorted(set(range(0, len(fr), step)) | {len(fr) - 1} | {i for i, p in enumerate(fr) if "evaluated_as" in p})
    for i in rows:
        p = fr[i]
        lines.append(f"| {p['predicted_ms']:.4f} | {p['damage']:.2e} | {_counts_text(p['formats'])} | "
                     f"{'; '.join(p.get('evaluated_as', []))} |")
    lines += ["", f"## Chosen plan per layer group ({report['chosen']})", "", "| group | format | members |",
              "| --- | --- | --- |"]
    for g, fmt in chosen.plan.items():
        lines.append(f"| {g} | {fmt} | {', '.join(m.rsplit('.', 1)[-1] for m in groups[g].members[:4])}"
                     f"{' …' if len(groups[g].members) > 4 else ''} |")
    path.write_text("\n".join(lines) + "\n")


_STYLE = {"bf16": ("X", 9), "uniform": ("D", 7), "ours": ("o", 7), "peer": ("s", 8)}
_ROLE_NAMES = {"bf16": "BF16", "uniform": "all-FP8 / all-NVFP4", "ours": "our frontier points",
               "peer": "published recipes"}


def _plot(path: Path, plans: list[Candidate], chosen: Candidate, frontier: list[FrontierPoint], target: str,
          tolerance: float) -> None:
    """Top: the predicted frontier (step time vs expected KL) with every candidate at its
    predicted point. Bottom: the measured NED increase over BF16 (95% CI) of every candidate,
    the tolerance line, our non-dominated evaluated candidates, and the chosen plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, (top, bot) = plt.subplots(2, 1, figsize=(10, 8.5), sharex=True, gridspec_kw={"height_ratios": [1, 1.2]})
    top.plot([p.time * 1e3 for p in frontier], [p.damage for p in frontier], "-", color="0.45", lw=1.4,
             zorder=1, label=f"our Pareto frontier ({len(frontier)} plans)")
    cmap = plt.get_cmap("tab20")
    for i, c in enumerate(plans):
        marker, size = _STYLE[c.role]
        color = cmap((2 * i) % 20 + (i // 10) % 2)
        hollow = c.target != target  # other numerics than the search's target
        kw = dict(marker=marker, markersize=size, color=color, linestyle="none",
                  markerfacecolor="none" if hollow else color, markeredgecolor=color)
        name = f"{c.label}" + (f" ({c.target})" if hollow else "")
        top.plot(c.predicted_s * 1e3, c.damage, zorder=3, **kw)
        d = c.delta
        bot.errorbar(c.predicted_s * 1e3, d.estimate, yerr=[[d.estimate - d.low], [d.high - d.estimate]], capsize=3,
                     zorder=3, label=name, **kw)
    # our evaluated candidates that no other of ours beats on both axes (measured)
    ours = sorted((c for c in plans if c.role != "peer" and c.target == target), key=lambda c: c.predicted_s)
    best, stairs = float("inf"), []
    for c in ours:
        if c.delta.estimate < best:
            best = c.delta.estimate
            stairs.append((c.predicted_s * 1e3, best))
    if len(stairs) > 1:
        bot.step(*zip(*stairs), where="post", color="0.55", lw=1, linestyle=":", zorder=2,
                 label="ours, non-dominated (measured)")
    for ax, y in ((top, chosen.damage), (bot, chosen.delta.estimate)):
        ax.plot(chosen.predicted_s * 1e3, y, marker="*", markersize=20, color="gold", markeredgecolor="black",
                linestyle="none", zorder=4, label=f"chosen: {chosen.label}" if ax is bot else None)
    bot.axhline(tolerance, color="crimson", linestyle="--", lw=1.2, label=f"tolerance +{tolerance} (95% upper bound)")
    bot.axhline(0.0, color="0.7", lw=0.8)
    positive = [p.damage for p in frontier if p.damage > 0] + [c.damage for c in plans if c.damage > 0]
    top.set_yscale("symlog", linthresh=min(positive) if positive else 1e-12)
    top.set_ylim(0, 2 * max(positive) if positive else 1.0)
    top.set_ylabel("predicted KL / token (calibration)")
    top.set_title(f"ocriaquant search ({target}): predicted frontier, and what the held-out pages measured")
    roles = [Line2D([], [], marker=_STYLE[r][0], color="0.3", linestyle="none", label=_ROLE_NAMES[r])
             for r in ROLES if any(c.role == r for c in plans)]
    roles.append(Line2D([], [], marker="o", color="0.3", markerfacecolor="none", linestyle="none",
                        label="hollow: other target's numerics"))
    handles, _ = top.get_legend_handles_labels()
    top.legend(handles=handles + roles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    bot.set_xlabel(f"predicted decode step time on {target} (ms)")
    bot.set_ylabel("ΔNED vs BF16, held-out pages (95% CI)")
    bot.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
