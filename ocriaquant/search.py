"""`ocriaquant search`: pick a format per layer group, fastest within a parsing-quality tolerance.

1. Space: a YAML policy (ocriaquant/recipes/default.yaml) pins or forbids formats by group pattern.
2. Cost: predicted decode-step time per group and format on the target GPU, from a measured
   latency table (benchmarks/bench_kernels.py) where it has the shape, otherwise bytes moved /
   bandwidth (H200 4.8 TB/s, B200 8 TB/s).
3. Solver: the exact Pareto frontier of predicted step time against summed sensitivity
   (calibration's expected KL per token), built group by group with dominated partial plans
   pruned — from all-BF16 to all-NVFP4.
4. Candidates: all-BF16, all-FP8, all-NVFP4 (both targets' numerics) and frontier points
   spread between all-FP8 and all-NVFP4 in predicted time. Each is built in our runtime, in
   memory, from the BF16 model's tensors and its plan (weights quantized with quant/ exactly as
   the checkpoint will hold them; FP8 activations per token, NVFP4 W4A16 for h200 or W4A4 for
   b200, as the runtime computes them), and every held-out page with ground truth (up to
   `eval_pages`) is decoded through the batched engine, in full, to EOS. The pages are encoded
   once, and the vision tower (BF16 in every plan) runs once per page, for all candidates.
5. Speed: on a GPU the finalists (ours and the peers, in the target's numerics) are timed in the
   same runtime: the decode step at batch 1 and at the served batch, and with `--objective
   throughput` the pages/s within a p90 latency objective. The chosen plan is the one best at
   the user's objective (measured where measured, else predicted) whose NED increase over BF16
   has an upper 95% bound within the tolerance. The report puts predicted and measured step time
   side by side per candidate, with their rank correlation (Spearman); a target the runtime
   cannot run at speed (b200: no FP4 tensor-core kernel) gets a projection, labelled as one.
6. Peers: the recipes the field publishes for Qwen3.5 (ocriaquant/recipes/peers/*.yaml, see peers.py)
   are mapped onto the model's groups and evaluated beside ours — same numerics, same pages,
   same cost model, same runtime — and the report says where each sits against our frontier and
   whether the chosen plan dominates it. They are compared, never chosen.
"""

from __future__ import annotations

import fnmatch
import gc
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import yaml

from .artifacts import (DEFAULT_CALIBRATION, DEFAULT_SEARCH, Plan, calibrated_model, input_absmax, load_calibration,
                        page_hash, save_plan)
from .errors import OcriaError
from .files import write_json_atomic
from .journal import DecodeJournal
from .model.groups import BITS_PER_WEIGHT, FORMATS
from .peers import PeerPlan, select as select_peers
from .recipes import RECIPES

DEFAULT_POLICY = RECIPES / "default.yaml"
BANDWIDTH = {"h200": 4.8e12, "b200": 8.0e12}  # bytes/s
# B200 dense tensor-core rates (FLOP/s, NVIDIA's datasheet) by weight format: what the b200
# projection divides a Linear's FLOPs by (W4A4 runs on the FP4 tensor cores, W8A8 on FP8's).
B200_TENSOR_RATE = {"bf16": 2.25e15, "fp8": 4.5e15, "nvfp4": 9.0e15}
OBJECTIVES = ("latency", "throughput")
PROJECTION = ("b200 rows: a projection, never a measurement — per Linear the larger of its bytes (weights as "
              "stored, BF16 activations) ÷ 8 TB/s and 2·N·K·batch FLOPs ÷ the B200's dense tensor-core rate for its "
              "format (BF16 2.25, FP8 4.5, FP4 9 PFLOP/s), summed over the decoder's Linears")


@dataclass(frozen=True)
class SearchOptions:
    target: str = "h200"                  # h200 (NVFP4 weight-only, FP8 W8A8) or b200 (NVFP4 W4A4)
    batch: int = 1                        # the batch the user serves at: step time predicted (and measured) there
    max_ned_increase: float = 0.01        # tolerance: NED increase over BF16, 95% upper bound
    policy: str | Path | None = None      # search-space YAML (None: ocriaquant/recipes/default.yaml)
    latency_table: str | Path | None = None  # measured latencies (None: bytes / bandwidth)
    eval_pages: int = 256                 # held-out pages with ground truth decoded per candidate: all, up to this
    candidates: int = 4                   # frontier points evaluated besides BF16 / FP8 / NVFP4
    device: str = "cpu"
    dtype: str = "bf16"                   # the runtime's compute dtype (bf16: as the checkpoint is served)
    batch_size: int = 64                  # pages the runtime decodes together (its slots)
    max_new_tokens: int | None = None     # cap per page; below it each page has room for 1.25x its reference + 16
    peers: str = "all"                    # published recipes evaluated beside ours: none, all or NAME,NAME
    backend: str | None = None            # the runtime's backend (None: triton on a GPU, torch on the CPU)
    objective: str = "latency"            # latency: the batch-1 decode step; throughput: pages/s within slo_p90
    slo_p90: float | None = None          # seconds: the p90 page latency the throughput objective holds
    measure: bool | None = None           # time the finalists in the runtime (None: on a GPU yes, on the CPU no)
    measure_steps: int = 32               # decode steps timed per batch


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


def projected_step(groups, plan: dict[str, str], batch: int, target: str = "b200") -> float:
    """A projection, never a measurement: the decode step's Linears on `target` (b200), each the
    larger of its bytes (weights as stored, BF16 activations in and out) ÷ the GPU's bandwidth
    and its 2·N·K·batch FLOPs ÷ the dense tensor-core rate of its format (B200_TENSOR_RATE),
    summed. The same traffic the analytical cost model counts, and the same omissions."""
    t = 0.0
    for g in groups.values():
        if g.kind == "vision":
            continue
        fmt = "bf16" if g.always_bf16 else plan.get(g.name, "bf16")
        for n, k in g.shapes:
            moved = n * k * BITS_PER_WEIGHT[fmt] / 8 + batch * (n + k) * 2
            t += max(moved / BANDWIDTH[target], 2 * n * k * batch / B200_TENSOR_RATE[fmt])
    return t


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation (ties share their mean rank); None below 3 points or when
    either side is constant."""
    if len(x) < 3:
        return None

    def ranks(v):
        v = np.asarray(v, dtype=float)
        order = v.argsort(kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for u in np.unique(v):  # ties: the mean of their ranks
            r[v == u] = r[v == u].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


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
    predicted_s: float                                      # predicted decode step at the served batch
    damage: float
    role: str = "ours"                                      # one of ROLES
    frontier_index: int | None = None                       # its row in the frontier (our candidates)
    predicted_b1_s: float = 0.0                             # predicted decode step at batch 1
    ned: list[float] = field(default_factory=list)          # vs ground truth, per page
    ned_vs_bf16: list[float] = field(default_factory=list)  # vs the BF16 model's output
    same_as_bf16: float = 0.0                               # fraction of pages with identical output
    delta: object = None                                    # Interval: NED(candidate) - NED(BF16)
    decoded_as: str | None = None                           # an earlier candidate with the same numerics
    reused: bool = False                                    # its outputs from an earlier run (journal.py)
    decode_s: float = 0.0                                   # wall time of its held-out decode (0: shared); report only
    tokens: int = 0                                         # tokens its held-out decode generated (0: shared)
    measured: dict | None = None                            # timed in the runtime (Judge.measure)
    projected: dict | None = None                           # b200 projection (projected_step), ms
    speed_s: float = 0.0                                    # the objective, seconds (lower is better)
    preds: list[str] = field(default_factory=list, repr=False)  # its held-out outputs

    def summary(self) -> dict:
        from .eval import bootstrap_mean

        ci = bootstrap_mean(self.ned)
        return {"label": self.label, "role": self.role, "target": self.target, "predicted_ms": self.predicted_s * 1e3,
                "predicted_b1_ms": self.predicted_b1_s * 1e3, "measured": self.measured, "projected": self.projected,
                "damage": self.damage, "ned": ci.estimate, "ned_ci": [ci.low, ci.high],
                "ned_vs_bf16": float(np.mean(self.ned_vs_bf16)), "same_as_bf16": self.same_as_bf16,
                "ned_increase": None if self.delta is None else [self.delta.estimate, self.delta.low, self.delta.high],
                "formats": format_counts(self.plan), "decoded_as": self.decoded_as, "reused": self.reused}


def _numerics_key(c: Candidate) -> tuple:
    """Candidates with equal keys run the same model: FP8 is W8A8 on both targets, and only
    NVFP4 differs between them."""
    quantized = tuple(sorted((g, f) for g, f in c.plan.items() if f != "bf16"))
    return (c.target if any(f == "nvfp4" for _, f in quantized) else "any", quantized)


def page_room(tokenizer, page, cap: int | None = None) -> int:
    """Tokens a page may decode: 1.25x its reference plus 16 (a model that runs on past the
    truth is seen to), at most `cap`."""
    room = int(len(tokenizer(page.reference or "")["input_ids"]) * 1.25) + 16
    return min(room, cap) if cap else room


def _page_key(pixels: torch.Tensor, grid) -> tuple:
    """A page's patches, summed up: where to look for the features the vision tower gave them."""
    return (tuple(int(v) for v in grid), float(pixels.float().sum()), float(pixels.float().square().sum()))


class _VisionOnce(torch.nn.Module):
    """The vision tower's output per page, computed by the first candidate and handed to the
    next: every plan keeps the tower in BF16 (the policy pins it, and quantize_in_memory never
    touches model.visual.*), so its output for a page is the same in all of them. The runtime
    may pass several pages' patches in one call (split here by `grid_thw`). A page is a hit when
    its patches equal, bit for bit, those of a held-out page (`pages`: key -> patches, the judge's
    encodings) whose features are known; the misses go through the tower together, and only the
    held-out pages' features are kept. The runtime reads `pooler_output` only."""

    def __init__(self, tower: torch.nn.Module, memo: dict, pages: dict, merge: int):
        super().__init__()
        self.tower, self.memo, self.pages, self.merge = tower, memo, pages, merge

    def forward(self, pixel_values, grid_thw=None, **kwargs):
        from types import SimpleNamespace

        from .runtime.models.qwen3_5 import vision_cu_seqlens

        if grid_thw is None:
            return self.tower(pixel_values, **kwargs)
        grid = grid_thw.cpu()
        rows = [int(n) for n in grid.prod(-1).tolist()]  # patches per page
        parts = pixel_values.split(rows)
        keys = [_page_key(p, g) for p, g in zip(parts, grid)]
        known = [k in self.pages and torch.equal(self.pages[k], p) for k, p in zip(keys, parts)]
        miss = [i for i, k in enumerate(keys) if not (known[i] and k in self.memo)]
        feats = {}
        if miss:
            if "cu_seqlens" in kwargs:  # the runtime's images' bounds are the whole call's: the misses' instead
                kwargs["cu_seqlens"] = vision_cu_seqlens(grid[miss])
            out = self.tower(torch.cat([parts[i] for i in miss]), grid_thw=grid_thw[miss], **kwargs).pooler_output
            for i, f in zip(miss, out.split([rows[i] // self.merge for i in miss])):
                feats[i] = f
                if known[i]:
                    self.memo[keys[i]] = f
        return SimpleNamespace(pooler_output=torch.cat([feats[i] if i in feats else self.memo[k]
                                                        for i, k in enumerate(keys)]))


class Judge:
    """Builds each candidate in our runtime from the BF16 model's tensors and its plan, in memory
    (runtime.load.quantize_in_memory: the tensors its checkpoint would hold), decodes the held-out
    pages through the batched engine, and times the step (runtime.measure).

    The model's tensors are read once onto the device; the pages are encoded once; quantized
    units are kept for the next candidate that shares them; the vision tower runs once a page."""

    def __init__(self, model_dir: Path, config, processor, pages, limits: list[int], groups, absmax, opts):
        from .model.load import to_dtype
        from .model.processor import chat_text
        from .runtime.config import RuntimeConfig
        from .runtime.load import TensorStore

        self.config, self.processor, self.groups, self.absmax = config, processor, groups, absmax
        self.limits, self.opts = limits, opts
        dev, dtype = torch.device(opts.device), to_dtype(opts.dtype)
        store = TensorStore(model_dir)
        self.base = {k: store.get(k).to(dev) for k in store.where if not k.startswith("mtp.")}
        self.encs = []
        for p in pages:  # what Engine.encode makes, once, where the runtime reads it
            enc = dict(processor(images=[p.image], text=[chat_text(processor, p.prompt)], return_tensors="pt"))
            enc = {k: v.to(dev, dtype) if k == "pixel_values" else v.to(dev) for k, v in enc.items()}
            self.encs.append(enc)
        prompts = [e["input_ids"].shape[1] for e in self.encs]
        truth = [len(processor.tokenizer(p.reference or "")["input_ids"]) for p in pages]
        # what a page outputs where its speed is measured: the median ground truth (throughput)
        self.out_tokens = max(1, min(int(np.median(truth)), opts.max_new_tokens or 1 << 30))
        self.context = int(np.mean(prompts)) + self.out_tokens // 2  # cached tokens per row when the step is timed
        self.slots = max(1, min(opts.batch_size, len(pages)))
        need = max(p + n for p, n in zip(prompts, limits))
        if self.measuring:
            self.slots = max(self.slots, opts.batch)
            need = max(need, self.context + opts.measure_steps + 8)
        self.backend = opts.backend or ("triton" if dev.type == "cuda" else "torch")
        self.rc = RuntimeConfig(backend=self.backend, device=dev, dtype=dtype, max_slots=self.slots, max_len=need + 8)
        self.cache: dict = {}
        self.vision: dict = {}  # page key -> its vision features (_VisionOnce)
        self.pages = {_page_key(e["pixel_values"], e["image_grid_thw"][0]): e["pixel_values"]
                      for e in self.encs if "pixel_values" in e}

    @property
    def measuring(self) -> bool:
        return bool(self.opts.measure if self.opts.measure is not None else self.opts.device.startswith("cuda"))

    def build(self, plan: dict[str, str], target: str):
        from .runtime.load import MemoryStore, quantize_in_memory, runtime_kind
        from .runtime.model_runner import ModelRunner

        units = [(self.groups[g].members, runtime_kind(f, target)) for g, f in plan.items()
                 if f != "bf16" and self.groups[g].kind != "vision"]
        tensors, kinds = quantize_in_memory(self.base, units, self.absmax, self.cache)
        rt = ModelRunner(None, self.rc, source=(self.config, MemoryStore(tensors, "candidate (in memory)"), kinds))
        tower = getattr(rt.model, "visual", None)
        if isinstance(tower, torch.nn.Module):
            rt.model.visual = _VisionOnce(tower, self.vision, self.pages,
                                          self.config.vision_config.spatial_merge_size ** 2)
        return rt

    def decode(self, rt, on_page=None) -> tuple[list[str], int]:
        """Every page's text, to EOS or its limit, and the tokens generated."""
        from .runtime.engine import Engine

        engine = Engine(runner=rt, processor=self.processor)
        texts, tokens = [""] * len(self.encs), 0
        for r in engine.generate(list(zip(self.encs, self.limits)), max_batch=self.slots):
            texts[r.rid] = r.text
            tokens += len(r.tokens)
            if on_page:
                on_page(len(r.tokens))
        return texts, tokens

    def measure(self, rt) -> dict:
        """The candidate's decode step at batch 1 and at the served batch (ms), and with the
        throughput objective its pages/s within the p90 objective, on this device."""
        from .runtime.engine import Engine
        from .runtime.measure import decode_speed, pages_at_slo

        o, vocab = self.opts, self.config.text_config.vocab_size
        out = {"step_b1_ms": decode_speed(rt, 1, self.context, o.measure_steps, vocab) * 1e3}
        if o.batch != 1:
            out["step_batch_ms"] = decode_speed(rt, o.batch, self.context, o.measure_steps, vocab) * 1e3
        if o.objective == "throughput":
            if isinstance(rt.model.visual, _VisionOnce):  # pages served pay for their vision tower
                rt.model.visual = rt.model.visual.tower
            out["slo"] = pages_at_slo(Engine(runner=rt, processor=self.processor), self.encs, o.slo_p90,
                                      self.out_tokens)
        return out

    def release(self) -> None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def describe(self) -> dict:
        dev = self.rc.device
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        return {"device": name, "backend": self.backend, "dtype": self.opts.dtype, "slots": self.slots,
                "cuda_graphs": self.backend == "triton" and dev.type == "cuda", "context": self.context,
                "steps": self.opts.measure_steps, "out_tokens": self.out_tokens}


def _check_options(o: SearchOptions) -> None:
    """Refuse options that cannot work before anything is loaded or decoded."""
    import os

    if o.objective not in OBJECTIVES:
        raise OcriaError(f"unknown objective {o.objective!r}; choose latency (the batch-1 decode step) or "
                         "throughput (pages/s within --slo-p90)")
    if o.objective == "throughput" and not (o.slo_p90 and o.slo_p90 > 0):
        raise OcriaError("--objective throughput needs --slo-p90 SECONDS: the p90 page latency the pages/s are "
                         "measured within")
    if o.eval_pages < 1 or o.batch_size < 1 or o.batch < 1 or o.measure_steps < 1:
        raise OcriaError(f"--eval-pages, --batch-size, --batch and the timed steps are at least 1; got "
                         f"{o.eval_pages}, {o.batch_size}, {o.batch}, {o.measure_steps}")
    if o.device.startswith("cuda") and not torch.cuda.is_available():
        raise OcriaError("no CUDA device here; search on the CPU with --device cpu")
    if o.backend not in (None, "torch", "triton"):
        raise OcriaError(f"unknown runtime backend {o.backend!r}; torch or triton")
    if o.backend == "triton" and not o.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise OcriaError("the triton backend needs a GPU (or TRITON_INTERPRET=1 on the CPU, very slowly)")


def run_search(calib: str | Path | None = None, pages: str | Path | None = None, out: str | Path | None = None,
               options: SearchOptions | None = None, *, console=None, **fields) -> dict:
    """Search the calibration artifact `calib` (default ocriaquant-out/calib) and write plan.json,
    report.json, report.md and pareto.png to `out`; returns the report. Fields of SearchOptions
    may also be given by name (`target="b200"`)."""
    from rich.console import Console

    from .data import load_pages, select_split
    from .eval import ned, paired_bootstrap
    from .model import discover_groups, load_config, meta_model
    from .model.processor import load_processor

    opts = replace(options or SearchOptions(), **fields)
    _check_options(opts)
    target, tolerance, objective = opts.target, opts.max_ned_increase, opts.objective
    console = console or Console(stderr=True)
    out = Path(out) if out else DEFAULT_SEARCH
    calib_path = Path(calib) if calib else DEFAULT_CALIBRATION
    calibration = load_calibration(calib_path)
    sens, model_dir = calibration.sensitivity, calibrated_model(calibration, calib_path)
    cost = CostModel.load(target, opts.batch, opts.latency_table)
    cost1 = cost if opts.batch == 1 else CostModel.load(target, 1, opts.latency_table)
    pol = Policy.load(opts.policy)
    peer_recipes = select_peers(opts.peers)  # a bad name or recipe fails before any decoding

    config = load_config(model_dir)
    groups = {g.name: g for g in discover_groups(meta_model(config))}  # shapes only: the runtime holds the weights
    allowed = pol.allowed(list(groups), {g for g, grp in groups.items() if grp.always_bf16})
    choices = {g: [(f, cost.group_time(groups[g], f), 0.0 if f == "bf16" else sens[target][g][f]) for f in fmts]
               for g, fmts in allowed.items() if groups[g].kind != "vision"}
    frontier = pareto_frontier(choices)
    mapped = [r.map(list(groups.values())) for r in peer_recipes]

    def total(plan, tgt=target, cm=cost):
        t = sum(cm.group_time(groups[g], f) for g, f in plan.items() if groups[g].kind != "vision")
        d = sum(0.0 if f == "bf16" else sens[tgt][g][f] for g, f in plan.items() if groups[g].kind != "vision")
        return t, d

    pages_dir = Path(pages) if pages else calibration.pages_dir
    held_all = [p for p in select_split(load_pages(pages_dir).pages, "heldout") if p.has_reference]
    held = held_all[:opts.eval_pages]
    if not held:
        raise OcriaError(f"{pages_dir}: no held-out pages with ground truth to evaluate candidates on")
    proc = load_processor(model_dir)
    limits = [page_room(proc.tokenizer, p, opts.max_new_tokens) for p in held]
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
    for c in plans:
        c.predicted_b1_s = total(c.plan, c.target, cost1)[0]
        if c.target == "b200":
            c.projected = {"step_b1_ms": projected_step(groups, c.plan, 1) * 1e3,
                           "step_batch_ms": projected_step(groups, c.plan, opts.batch) * 1e3}

    judge = Judge(model_dir, config, proc, held, limits, groups, absmax, opts)
    measuring, why_not = judge.measuring, None
    runtime = judge.describe()
    journal = DecodeJournal(out / "candidates",
                            {"calibration": calibration.meta["fingerprint"], "limits": limits,
                             "pages": [[p.name, page_hash(p)] for p in held],
                             "runtime": {k: runtime[k] for k in ("device", "backend", "dtype", "slots", "cuda_graphs")}},
                            {**runtime, "batch": opts.batch, "objective": objective, "slo_p90": opts.slo_p90})
    if not measuring:
        why_not = ("--no-measure" if opts.measure is False else
                   "on the CPU the torch backend would be timed, which is not how the checkpoint is served; "
                   "`--measure` times it anyway, `--device cuda` times the triton backend on the GPU")
    elif target == "b200":
        measuring, why_not = False, ("target b200: the runtime has no FP4 tensor-core (W4A4) kernel, so timing it "
                                     "here would time an emulation; the b200 rows carry a projection instead")

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    decoded: dict[tuple, Candidate] = {}  # numerics -> the candidate decoded (and timed) with them
    t_all = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console, transient=True) as bar:
        cands = bar.add_task("candidates", total=len(plans), info="")
        pages_task = bar.add_task("  pages", total=len(held), info="")
        base_out = None
        for c in plans:
            bar.update(cands, description=f"evaluating {c.label}")
            key = _numerics_key(c)
            want_speed = measuring and c.target == target
            first = decoded.get(key)
            kept = journal.get(key) if first is None else None  # an earlier run's decode of these numerics
            if first is not None and (first.measured is not None or not want_speed):
                c.decoded_as, preds, c.measured = first.label, first.preds, first.measured
            elif kept is not None and (kept[2] is not None or not want_speed):
                (preds, c.tokens, c.measured), c.reused = kept, True
            else:
                rt = judge.build(c.plan, c.target)
                if first is not None:  # same numerics decoded already; only its speed is missing
                    c.decoded_as, preds, toks = first.label, first.preds, first.tokens
                elif kept is not None:  # decoded by an earlier run, timed otherwise (or not at all)
                    (preds, toks, _), c.reused = kept, True
                    c.tokens = toks
                else:
                    bar.reset(pages_task, total=len(held))
                    t0, seen = time.perf_counter(), [0]

                    def on_page(n, t0=t0, seen=seen):
                        seen[0] += n
                        bar.update(pages_task, advance=1,
                                   info=f"{seen[0] / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s")

                    preds, c.tokens = judge.decode(rt, on_page)
                    c.decode_s, toks = time.perf_counter() - t0, c.tokens
                    journal.put(key, preds, toks)
                if want_speed:
                    bar.update(pages_task, info="timing the decode step")
                    c.measured = judge.measure(rt)
                    journal.put(key, preds, toks, c.measured)
                del rt
                judge.release()
            c.preds = preds
            decoded.setdefault(key, c)
            if base_out is None:
                base_out = preds
            c.ned = [ned(y, p.reference) for y, p in zip(preds, held)]
            c.ned_vs_bf16 = [ned(y, b) for y, b in zip(preds, base_out)]
            c.same_as_bf16 = float(np.mean([y == b for y, b in zip(preds, base_out)]))
            bar.advance(cands)
    decode_wall = time.perf_counter() - t_all
    del judge  # the model's tensors and the quantized units go back before export runs in this process
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for c in plans:
        c.delta = paired_bootstrap(plans[0].ned, c.ned)

    # the objective, in seconds (lower is better): measured where measured, else predicted
    def speed(c: Candidate) -> float:
        m = c.measured
        if m is None:
            return c.predicted_b1_s if objective == "latency" else c.predicted_s
        if objective == "latency":
            return m["step_b1_ms"] * 1e-3
        pps = m["slo"]["pages_per_s"]
        return 1.0 / pps if pps > 0 else math.inf

    for c in plans:
        c.speed_s = speed(c)
    basis = _basis(objective, opts.batch, measuring, runtime["device"], why_not)

    bf16, fp8 = plans[0], plans[1]
    ours = [c for c in plans if c.role != "peer" and c.target == target]
    ok = [c for c in ours[1:] if c.delta.high <= tolerance]
    chosen = min(ok, key=lambda c: c.speed_s) if ok else bf16
    if chosen is not bf16 and chosen.speed_s >= bf16.speed_s:  # measured: quantizing may not pay on this GPU
        verdict = (f"no candidate of ours within +{tolerance} NED beats BF16 at the objective ({basis['what']}: "
                   f"the best, {chosen.label}, is {bf16.speed_s / chosen.speed_s:.2f}x BF16's speed), so BF16 is "
                   "kept.")
        chosen = bf16
    elif chosen is bf16:
        verdict = (f"no candidate of ours stays within +{tolerance} NED of BF16 at the 95% upper bound "
                   f"(all-FP8: {fp8.delta.high:+.4f}), so BF16 is kept. Raise --max-ned-increase or evaluate more "
                   "pages.")
    else:
        speed_txt = f"{bf16.speed_s / chosen.speed_s:.2f}x the speed of BF16"
        if chosen is not fp8:
            speed_txt += f" and {fp8.speed_s / chosen.speed_s:.2f}x all-FP8"
        verdict = (f"{basis['word']} {speed_txt} ({basis['what']}); NED {chosen.delta.estimate:+.4f} over BF16 "
                   f"(95% CI upper {chosen.delta.high:+.4f}, tolerance {tolerance})")
        if chosen.speed_s >= fp8.speed_s and not measuring and t_fp8 <= t_fast * 1.001:
            verdict += (f". No plan is predicted faster than all-FP8 with this cost model ({cost.source}): there, "
                        "FP8 is the fastest format for every group")
        elif chosen.speed_s >= fp8.speed_s:
            verdict += (f". No plan beats all-FP8 within the tolerance ({basis['word']}): every faster candidate's "
                        f"NED increase exceeds +{tolerance} at the 95% upper bound")
        verdict += "."

    peer_reports = [_peer_report(m, c, chosen, ours, bf16, frontier, allowed, tolerance, paired_bootstrap)
                    for m, c in zip(mapped, [c for c in plans if c.role == "peer"])]

    timed = [c for c in plans if c.measured is not None and c.decoded_as is None]  # each model once
    speed_report = {"objective": objective, "slo_p90_s": opts.slo_p90, "basis": basis["what"],
                    "measured": measuring, "not_measured_because": why_not,
                    "runtime": runtime if measuring else None,
                    "spearman_b1": spearman([c.predicted_b1_s for c in timed],
                                            [c.measured["step_b1_ms"] for c in timed]),
                    "spearman_batch": None if opts.batch == 1 else spearman(
                        [c.predicted_s for c in timed], [c.measured["step_batch_ms"] for c in timed]),
                    "timed": len(timed),
                    "projection": PROJECTION if any(c.projected for c in plans) else None}

    out.mkdir(parents=True, exist_ok=True)
    predicted = {"step_ms": chosen.predicted_s * 1e3, "step_b1_ms": chosen.predicted_b1_s * 1e3,
                 "damage_kl_per_token": chosen.damage, "cost_model": cost.source}
    chosen_plan = Plan(groups=chosen.plan, target=target, model_dir=model_dir, calibration=calib_path,
                       model_fingerprint=calibration.model_fingerprint,
                       evidence={"batch": opts.batch, "objective": objective, "predicted": predicted,
                                 "measured": chosen.summary(), "speed": chosen.measured,
                                 "speed_device": speed_report["runtime"], "tolerance": tolerance})
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
              "verdict": verdict, "chosen": chosen.label, "eval_pages": len(held), "heldout_with_truth": len(held_all),
              "eval_page_names": [p.name for p in held],
              "decoding": {**runtime, "pages": len(held), "max_new_tokens": opts.max_new_tokens,
                           "page_limits": [min(limits), max(limits)],
                           "tokens": sum(c.tokens for c in plans if not c.reused),
                           "tok_per_s": round(sum(c.tokens for c in plans if not c.reused)
                                              / max(sum(c.decode_s for c in plans), 1e-9), 1),
                           "wall_s": round(decode_wall, 1)},
              "speed": speed_report,
              "frontier_points": len(frontier),
              "frontier": [{"predicted_ms": p.time * 1e3, "damage": p.damage, "formats": format_counts(p.plan),
                            **({"evaluated_as": evaluated_as[i]} if i in evaluated_as else {})}
                           for i, p in enumerate(frontier)],
              "candidates": [{**c.summary(), "decode_s": round(c.decode_s, 2), "tokens": c.tokens,
                              "speed_ms": c.speed_s * 1e3} for c in plans],
              "decode_s": {"all": round(sum(c.decode_s for c in plans), 1),
                           "peers": round(sum(c.decode_s for c in plans if c.role == "peer"), 1)},
              "reused": [c.label for c in plans if c.reused],
              "peers": peer_reports,
              "peers_dominated_by_chosen": [r["name"] for r in peer_reports if r["chosen_dominates"]]}
    save_plan(out / "plan.json", chosen_plan)
    write_json_atomic(out / "report.json", report)
    _write_markdown(out / "report.md", report, chosen, groups)
    _plot(out / "pareto.png", plans, chosen, frontier, target, tolerance, basis)
    return report


def _basis(objective: str, batch: int, measured: bool, device: str, why_not: str | None) -> dict:
    """How the report words the speed the choice was made on."""
    if objective == "latency":
        what = f"batch-1 decode step, {'measured in our runtime on ' + device if measured else 'predicted'}"
        axis = "measured batch-1 decode step (ms)"
    else:
        what = (f"pages/s within the p90 latency objective, measured in our runtime on {device}" if measured else
                f"decode step at batch {batch}, predicted (pages/s are measured only where the runtime is timed)")
        axis = "measured ms per page (1000 / pages/s within the p90 objective)"
    return {"word": "measured" if measured else "predicted", "what": what, "axis": axis, "why_not": why_not}


# ---------------------------------------------------------------------------- peers against ours

def _dominates(a: Candidate, b: Candidate) -> bool:
    """`a` dominates `b`: no slower at the objective (measured where measured, else predicted)
    and mean held-out NED no worse, one of them strictly."""
    eps = 1e-9 * max(a.speed_s, b.speed_s)
    na, nb = float(np.mean(a.ned)), float(np.mean(b.ned))
    no_worse = a.speed_s <= b.speed_s + eps and na <= nb + 1e-12
    return no_worse and (a.speed_s < b.speed_s - eps or na < nb - 1e-12)


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
            "predicted_ms": s["predicted_ms"], "speed_vs_bf16": bf16.speed_s / c.speed_s,
            "damage": c.damage, "ned": s["ned"], "ned_ci": s["ned_ci"], "ned_increase": s["ned_increase"],
            "within_tolerance": c.delta.high <= tolerance,
            "frontier": _frontier_position(c, frontier, outside),
            "chosen": chosen.label, "chosen_dominates": chosen is not c and _dominates(chosen, c),
            "chosen_speed_vs_peer": c.speed_s / chosen.speed_s,
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
    dec, sp = report["decoding"], report["speed"]
    limit = f"at most {dec['max_new_tokens']} tokens" if dec["max_new_tokens"] else ""
    lines = [f"# ocriaquant search — target {report['target']}, batch {report['batch']}, "
             f"objective {sp['objective']}", "",
             f"**Chosen: {report['chosen']}** — {report['verdict']}", "",
             f"Cost model: {report['cost_model']} (predicted decode-step time; the same for every row). "
             f"Tolerance: NED increase over BF16 ≤ +{tol} at the 95% upper bound.", "",
             f"Held-out pages: {report['eval_pages']} of the {report['heldout_with_truth']} held-out pages with ground "
             "truth, the same for every row, each decoded in full — to EOS, or 1.25× its reference + 16 tokens"
             + (f", {limit}" if limit else "") + f" (here {dec['page_limits'][0]}–{dec['page_limits'][1]} tokens) "
             f"— by our runtime ({dec['backend']} backend on {dec['device']}, {dec['dtype']}, {dec['slots']} pages "
             "at a time) with the candidate's numerics: weights quantized exactly as its checkpoint holds them, FP8 "
             "activations per token, NVFP4 weight-only (h200) or W4A4 (b200). "
             f"Decoding took {report['decode_s']['all']:.0f} s"
             + (f" ({report['decode_s']['peers']:.0f} s of it for the published recipes)" if report["peers"] else "")
             + f", {dec['tokens']:,} tokens at {dec['tok_per_s']:,.0f} tok/s."
             + (f" {len(report['reused'])} of the {len(report['candidates'])} candidates' outputs came from an earlier "
                "run (`candidates/` beside this report: same model, calibration, pages, runtime and code); delete "
                "that folder to decode them again." if report["reused"] else ""), "",
             "Groups are counted over the decoder and lm_head; the vision tower is always BF16 and not counted.",
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
        lines += ["", "Same model, decoded once: " +
                  "; ".join(f"{c['label']} = {c['decoded_as']}" for c in shared) + "."]

    lines += ["", "## Speed: predicted and measured", ""] + _speed_lines(report)

    peers = report["peers"]
    lines += ["", "## Published recipes beside ours", ""]
    if not peers:
        lines += ["None evaluated (`--peers none`)."]
    else:
        lines += [f"The layouts the field publishes for Qwen3.5 (ocriaquant/recipes/peers/), mapped onto this "
                  f"model's layer groups and evaluated exactly like our candidates: {report['target']} numerics, the same "
                  f"{report['eval_pages']} held-out pages, the same runtime and cost model. They are compared, never "
                  f"chosen. *Dominates* means no slower ({sp['basis']}) and mean NED no worse, one of them "
                  "strictly; *speed vs BF16* is on the same basis.", "",
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


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:.4g}"


def _speed_lines(report: dict) -> list[str]:
    """The speed section of report.md: per candidate the predicted step, the measured one and
    their ratio (the cost model held to account), pages/s within the objective, b200 projections."""
    sp, b = report["speed"], report["batch"]
    obj = ("the batch-1 decode step" if sp["objective"] == "latency"
           else f"pages/s with the p90 page latency ≤ {sp['slo_p90_s']} s")
    lines = [f"Objective: **{sp['objective']}** — {obj}. The plan was chosen on: {sp['basis']}.", ""]
    rt = sp["runtime"]
    if sp["measured"]:
        lines += [f"Measured in our runtime on **{rt['device']}** ({rt['backend']} backend, {rt['dtype']}"
                  f"{', CUDA graphs' if rt['cuda_graphs'] else ''}): the decode step as the engine runs it (host loop "
                  f"included, each step launched before the last one's tokens are read), {rt['context']} tokens "
                  f"cached per row, the mean of {rt['steps']} chained steps after 3 untimed ones"
                  + (f"; pages/s: the held-out pages served at concurrency 1, 2, 4 … with {rt['out_tokens']} tokens "
                     f"each, the best level within the p90 objective" if sp["objective"] == "throughput" else "")
                  + f". Each model was timed once ({sp['timed']} models; rows that share one say so above).", ""]
    else:
        lines += [f"Not measured: {sp['not_measured_because']}. Speeds are the cost model's predictions.", ""]
    cols = ["candidate", "predicted b1 (ms)", "measured b1 (ms)", "measured ÷ predicted"]
    if b != 1:
        cols += [f"predicted b{b} (ms)", f"measured b{b} (ms)", "measured ÷ predicted"]
    if sp["objective"] == "throughput":
        cols += [f"pages/s (p90 ≤ {sp['slo_p90_s']} s)", "at concurrency", "p90 (s)"]
    proj = sp["projection"] is not None
    if proj:
        cols += ["b200 projection b1 (ms)"] + ([f"b200 projection b{b} (ms)"] if b != 1 else [])
    lines += ["| " + " | ".join(cols) + " |", "| --- |" + " ---: |" * (len(cols) - 1)]
    for c in report["candidates"]:
        m, p = c["measured"] or {}, c["projected"] or {}
        star = " ★" if c["label"] == report["chosen"] else ""
        row = [f"{c['label']}{star}", _ms(c["predicted_b1_ms"]), _ms(m.get("step_b1_ms")),
               f"{m['step_b1_ms'] / c['predicted_b1_ms']:.2f}" if m else "—"]
        if b != 1:
            row += [_ms(c["predicted_ms"]), _ms(m.get("step_batch_ms")),
                    f"{m['step_batch_ms'] / c['predicted_ms']:.2f}" if m else "—"]
        if sp["objective"] == "throughput":
            slo = m.get("slo") or {}
            row += [f"{slo['pages_per_s']:.3f}" if slo else "—", str(slo.get("concurrency") or "—"),
                    str(slo.get("p90_s") or "—")]
        if proj:
            row += [_ms(p.get("step_b1_ms"))] + ([_ms(p.get("step_batch_ms"))] if b != 1 else [])
        lines.append("| " + " | ".join(row) + " |")
    if sp["measured"]:
        rho = [f"batch 1: ρ = {sp['spearman_b1']:.3f}" if sp["spearman_b1"] is not None else
               "batch 1: too few distinct models to rank"]
        if b != 1:
            rho.append(f"batch {b}: ρ = {sp['spearman_batch']:.3f}" if sp["spearman_batch"] is not None else
                       f"batch {b}: too few distinct models to rank")
        lines += ["", f"Rank agreement of predicted and measured step time (Spearman, {sp['timed']} models): "
                      + "; ".join(rho) + ". The cost model prices the Linears' weight and activation traffic only "
                      "(no attention, GDN, norms or launches), so measured ÷ predicted sits above 1; what would "
                      "mislead the search is that ratio varying between candidates."]
    if proj:
        lines += ["", sp["projection"] + "."]
    return lines


_STYLE = {"bf16": ("X", 9), "uniform": ("D", 7), "ours": ("o", 7), "peer": ("s", 8)}
_ROLE_NAMES = {"bf16": "BF16", "uniform": "all-FP8 / all-NVFP4", "ours": "our frontier points",
               "peer": "published recipes"}


def _plot(path: Path, plans: list[Candidate], chosen: Candidate, frontier: list[FrontierPoint], target: str,
          tolerance: float, basis: dict) -> None:
    """Top: the predicted frontier (step time vs expected KL) with every candidate at its
    predicted point. Bottom, side by side: the NED increase over BF16 on the held-out pages (95%
    CI) of every candidate against its predicted step time (left) and against its measured speed
    (right; the candidates timed in the runtime, or why none was), with the tolerance line, our
    non-dominated evaluated candidates and the chosen plan."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, ax = plt.subplot_mosaic([["top", "top"], ["pred", "meas"]], figsize=(14, 9),
                                 gridspec_kw={"height_ratios": [1, 1.2]})
    top, pred, meas = ax["top"], ax["pred"], ax["meas"]
    top.plot([p.time * 1e3 for p in frontier], [p.damage for p in frontier], "-", color="0.45", lw=1.4,
             zorder=1, label=f"our Pareto frontier ({len(frontier)} plans)")
    cmap = plt.get_cmap("tab20")
    measured_x = {}  # candidate label -> x on the measured panel
    for c in plans:
        if c.measured is not None and math.isfinite(c.speed_s):
            measured_x[c.label] = c.speed_s * 1e3
    for i, c in enumerate(plans):
        marker, size = _STYLE[c.role]
        color = cmap((2 * i) % 20 + (i // 10) % 2)
        hollow = c.target != target  # other numerics than the search's target
        kw = dict(marker=marker, markersize=size, color=color, linestyle="none",
                  markerfacecolor="none" if hollow else color, markeredgecolor=color)
        name = f"{c.label}" + (f" ({c.target})" if hollow else "")
        top.plot(c.predicted_s * 1e3, c.damage, zorder=3, **kw)
        d = c.delta
        err = [[d.estimate - d.low], [d.high - d.estimate]]
        pred.errorbar(c.predicted_s * 1e3, d.estimate, yerr=err, capsize=3, zorder=3, label=name, **kw)
        if c.label in measured_x:
            meas.errorbar(measured_x[c.label], d.estimate, yerr=err, capsize=3, zorder=3, **kw)

    def stairs(axis, xs):
        # our evaluated candidates that no other of ours beats on both axes
        ours = sorted((c for c in plans if c.role != "peer" and c.target == target and c.label in xs),
                      key=lambda c: xs[c.label])
        best, pts = float("inf"), []
        for c in ours:
            if c.delta.estimate < best:
                best = c.delta.estimate
                pts.append((xs[c.label], best))
        if len(pts) > 1:
            axis.step(*zip(*pts), where="post", color="0.55", lw=1, linestyle=":", zorder=2,
                      label="ours, non-dominated")

    stairs(pred, {c.label: c.predicted_s * 1e3 for c in plans})
    stairs(meas, measured_x)
    star = dict(marker="*", markersize=20, color="gold", markeredgecolor="black", linestyle="none", zorder=4)
    top.plot(chosen.predicted_s * 1e3, chosen.damage, **star)
    pred.plot(chosen.predicted_s * 1e3, chosen.delta.estimate, label=f"chosen: {chosen.label}", **star)
    if chosen.label in measured_x:
        meas.plot(measured_x[chosen.label], chosen.delta.estimate, **star)
    for axis in (pred, meas):
        axis.axhline(tolerance, color="crimson", linestyle="--", lw=1.2,
                     label=f"tolerance +{tolerance} (95% upper bound)" if axis is pred else None)
        axis.axhline(0.0, color="0.7", lw=0.8)
        axis.set_ylabel("ΔNED vs BF16, held-out pages (95% CI)")
    positive = [p.damage for p in frontier if p.damage > 0] + [c.damage for c in plans if c.damage > 0]
    top.set_yscale("symlog", linthresh=min(positive) if positive else 1e-12)
    top.set_ylim(0, 2 * max(positive) if positive else 1.0)
    top.set_ylabel("predicted KL / token (calibration)")
    top.set_xlabel(f"predicted decode step time on {target} (ms)")
    top.set_title(f"ocriaquant search ({target}): predicted frontier, and what the held-out pages and the runtime "
                  "measured")
    roles = [Line2D([], [], marker=_STYLE[r][0], color="0.3", linestyle="none", label=_ROLE_NAMES[r])
             for r in ROLES if any(c.role == r for c in plans)]
    roles.append(Line2D([], [], marker="o", color="0.3", markerfacecolor="none", linestyle="none",
                        label="hollow: other target's numerics"))
    handles, _ = top.get_legend_handles_labels()
    top.legend(handles=handles + roles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    pred.set_xlabel(f"predicted decode step time on {target} (ms)")
    pred.set_title("predicted", fontsize=10)
    if measured_x:
        meas.set_xlabel(basis["axis"])
        meas.set_title(basis["what"].split(", ", 1)[-1], fontsize=10)
    else:
        meas.set_title("measured", fontsize=10)
        why = "\n".join(textwrap.wrap("not measured: " + (basis["why_not"] or ""), 50))
        meas.text(0.5, 0.5, why, ha="center", va="center", transform=meas.transAxes, fontsize=9, color="0.3",
                  bbox=dict(boxstyle="round", facecolor="white", edgecolor="0.8"))
        meas.set_xticks([])
    meas.sharey(pred)
    fig.tight_layout(rect=(0, 0, 0.79, 1))
    fig.legend(*pred.get_legend_handles_labels(), fontsize=7, loc="upper left", bbox_to_anchor=(0.795, 0.56),
               borderaxespad=0)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
