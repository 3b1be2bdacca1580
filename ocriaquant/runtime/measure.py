"""Timing a built runtime the way the engine runs it: the decode step at a batch (`decode_speed`),
pages/s and p50 / p90 latency at a concurrency (`page_speed`), and the most pages/s within a p90
latency objective (`pages_at_slo`). `ocriaquant bench` reports them for one checkpoint or shape;
`ocriaquant search` times its finalists with them. Below the verbs, so both can."""

from __future__ import annotations

import gc
import statistics
import time
from itertools import zip_longest
from typing import Callable

import torch

START_CONCURRENCY = 8  # where the SLO search starts: pages at 1 at a time cost the most to time


def decode_speed(rt, batch: int, context: int, steps: int, vocab: int) -> float:
    """Seconds per decode step at `batch` rows, host loop included, run as the engine runs it:
    each step launched chained to the last (greedy_step) before the last one's tokens are read.

    The first call captures the step's CUDA graph, and its warm-up compiles the step's kernels:
    the objects compiling leaves behind can make Python's collector pause the host loop inside
    the few tens of timed steps (~1.6 ms each at batch 1), which the GPU then waits out. So, as
    `timeit` does, the garbage is collected before timing and the collector stays off while it
    runs: what is timed is the steady step a serving loop sees, not a one-off pause.

    It writes rows 0 … batch-1 of the runner's state (slots are overwritten by the next prefill)."""
    g = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, vocab, (batch,), generator=g).tolist()
    slots, lengths, deltas = list(range(batch)), [context] * batch, [0] * batch
    pending = rt.greedy_step(tokens, slots, lengths, deltas)
    collecting = gc.isenabled()
    try:
        for i in range(3 + steps):
            if i == 3:
                pending.get()
                if rt.device.type == "cuda":
                    torch.cuda.synchronize(rt.device)
                gc.collect()
                gc.disable()
                t = time.perf_counter()
            lengths = [n + 1 for n in lengths]
            ahead = rt.greedy_step(None, slots, lengths, deltas)
            pending.get()  # the last step's tokens back on the host, as the engine reads them
            pending = ahead
        pending.get()
        return (time.perf_counter() - t) / steps
    finally:
        if collecting:
            gc.enable()


def page_speed(engine, encs: list[dict], concurrency: int, out_tokens: int) -> dict:
    """Pages/s, p50 / p90 latency (admission to last token) and tok/s of `encs` served at
    `concurrency`, each page generating `out_tokens` tokens (EOS ignored)."""
    t = time.perf_counter()
    res = list(engine.generate([(e, out_tokens) for e in encs], max_batch=concurrency, stop_at_eos=False))
    wall = time.perf_counter() - t
    return {"concurrency": concurrency, **page_stats([r.seconds for r in res], sum(len(r.tokens) for r in res), wall),
            "first_token_p50_s": round(statistics.median(r.first_token_s for r in res), 2),
            **({"accepted_length": acceptance_summary(merge_gave(r.gave for r in res))["accepted_length"]}
               if any(r.gave for r in res) else {})}  # speculative decoding: tokens per verify step


def page_stats(latencies: list[float], tokens: int, wall: float) -> dict:
    """Pages, seconds, pages/s, p50 / p90 latency and tok/s of pages served in `wall` seconds."""
    lat = sorted(latencies)
    q = statistics.quantiles(lat, n=10, method="inclusive") if len(lat) > 1 else lat * 9
    return {"pages": len(lat), "seconds": round(wall, 2), "pages_per_s": round(len(lat) / wall, 3),
            "p50_s": round(statistics.median(lat), 2), "p90_s": round(q[8], 2), "tok_per_s": round(tokens / wall, 1)}


def pages_at_slo(engine, encs: list[dict], slo_p90: float, out_tokens: int, max_concurrency: int | None = None,
                 pages: int | None = None, log: Callable[[str], None] | None = None,
                 on_level: Callable[[list[dict]], None] | None = None) -> dict:
    """The highest concurrency whose p90 page latency holds `slo_p90` seconds, and its pages/s:
    from 8, concurrency halves until p90 holds or doubles until it does not (up to max_concurrency,
    default the runner's slots), then bisects between the last level that held and the first
    that did not. Each level serves `pages` pages (default max(8, 2 × level): admissions
    staggered, not one burst), the encodings cycled. pages_per_s 0 when even one page at a
    time misses the objective. on_level gets the levels measured so far after each one."""
    max_concurrency = min(max_concurrency or engine.runner.max_slots, engine.runner.max_slots)
    if pages:  # more requests in flight than pages served measures nothing more
        max_concurrency = min(max_concurrency, pages)
    levels: dict[int, dict] = {}

    def level(c: int) -> dict:
        if c not in levels:
            n = pages or max(8, 2 * c)
            levels[c] = page_speed(engine, (encs * (n // len(encs) + 1))[:n], c, out_tokens)
            r = levels[c]
            if log:
                log(f"SLO search, concurrency {c}: {r['pages_per_s']} pages/s, p50 {r['p50_s']} s, p90 {r['p90_s']} s")
            if on_level:
                on_level([levels[k] for k in sorted(levels)])
        return levels[c]

    good, bad, c = 0, None, min(START_CONCURRENCY, max_concurrency)
    while c >= 1 and level(c)["p90_s"] > slo_p90:  # too many at the start: halve until one holds
        bad, c = c, c // 2
    if c >= 1:
        good, c = c, c * 2
        while bad is None and c <= max_concurrency:
            if level(c)["p90_s"] > slo_p90:
                bad = c
            else:
                good, c = c, c * 2
    if bad is None and good < max_concurrency:  # doubling stepped over the top: try it
        if level(max_concurrency)["p90_s"] > slo_p90:
            bad = max_concurrency
        else:
            good = max_concurrency
    while bad is not None and bad - good > max(1, good // 4):
        mid = (good + bad) // 2
        if level(mid)["p90_s"] > slo_p90:
            bad = mid
        else:
            good = mid
    held = levels.get(good)
    return {"slo_p90_s": slo_p90, "out_tokens": out_tokens, "pages_per_s": held["pages_per_s"] if held else 0.0,
            "concurrency": good or None, "p50_s": held["p50_s"] if held else None,
            "p90_s": held["p90_s"] if held else None, "levels": [levels[c] for c in sorted(levels)]}


__all__ = ["decode_speed", "page_speed", "page_stats", "pages_at_slo"]


def spec_step_speed(rt, batch: int, context: int, steps: int, vocab: int) -> dict:
    """A speculative step at `batch` rows (ModelRunner.spec_step: verify k+1 positions, commit, draft
    k): as the engine runs it, "step_s" (its CUDA graph where the runner has them, each step launched
    chained to the last before the last one's tokens are read, as decode_speed times plain steps);
    and eagerly with its phases timed apart (synchronized after each), "verify_s", "commit_s",
    "draft_s" and their "eager_step_s". Medians (phases) and means (chained) over `steps` steps
    after 2 untimed. The drafts are what the runner's MTP proposes; the step's cost does not depend
    on how many are accepted (fixed shapes). Rows 0 … batch-1 from `context` cached tokens, growing
    by up to k+1 a step (the runner needs max_len >= context + (steps + 5)·(k+1)); their state is
    overwritten by the next prefill."""
    g = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, vocab, (batch,), generator=g).tolist()
    slots, lengths, deltas = list(range(batch)), [context] * batch, [0] * batch
    sync = torch.cuda.synchronize if rt.device.type == "cuda" else (lambda *a: None)
    marks: list[tuple[str, float]] = []

    def clock(name):
        sync(rt.device)
        marks.append((name, time.perf_counter()))

    phases = {"verify": [], "commit": [], "draft": [], "eager_step": []}
    collecting = gc.isenabled()
    try:
        for i in range(2 + steps):  # eagerly, phase by phase
            if i == 2:
                gc.collect()
                gc.disable()
            marks.clear()
            sync(rt.device)
            t = time.perf_counter()
            rt.spec_step(tokens, slots, lengths, deltas, clock=clock).get()
            if i < 2:
                continue
            prev = t
            for name, at in marks:
                phases[name].append(at - prev)
                prev = at
            phases["eager_step"].append(time.perf_counter() - t)
        if collecting:
            gc.enable()
        k1 = rt.spec + 1
        pending = rt.spec_step(tokens, slots, lengths, deltas)
        for i in range(2 + steps):  # as the engine runs them: chained
            if i == 2:
                pending.get()
                sync(rt.device)
                gc.collect()
                gc.disable()
                t = time.perf_counter()
            ahead = rt.spec_step(None, slots, lengths, deltas)
            lengths = [n + k1 for n in lengths]  # an upper bound of where the rows are: max_len stays checked
            pending.get()
            pending = ahead
        pending.get()
        step_s = (time.perf_counter() - t) / steps
    finally:
        if collecting:
            gc.enable()
    return {**{f"{k}_s": statistics.median(v) for k, v in phases.items()}, "step_s": step_s}


def merge_gave(gaves) -> list[int]:
    """Verify steps by tokens given (Result.gave: n[j] steps gave j + 1), summed over requests."""
    total: list[int] = []
    for gave in gaves:
        total = [a + b for a, b in zip_longest(total, gave, fillvalue=0)]
    return total


def acceptance_summary(gave: list[int]) -> dict:
    """Verify steps, mean tokens per step and P(a step gives 1, 2, … tokens) from steps counted by
    tokens given: what `parse --spec` writes in summary.json, which `bench --acceptance` reads."""
    steps = sum(gave)
    if not steps:
        return {"verify_steps": 0, "accepted_length": None, "accepted_length_probs": None}
    return {"verify_steps": steps, "accepted_length": round(sum((j + 1) * n for j, n in enumerate(gave)) / steps, 3),
            "accepted_length_probs": [round(n / steps, 6) for n in gave]}


def accepted_lengths(acceptance, k: int) -> list[float]:
    """P(a verify step gives 1, 2, … k+1 tokens) from an acceptance description (bench's
    --acceptance FILE): {"accepted_length_probs": [p1, p2, …]} (the probability of each number of
    tokens a step gives, from 1: mass past k+1 counts as k+1), {"position_acceptance": [a1, a2, …]}
    (the chance that draft j is accepted when the drafts before it were: missing positions 0), or
    a bare list, read as accepted_length_probs. Other keys are ignored, so the summary.json of
    `ocriaquant parse --spec K` (acceptance_summary) is one: the distribution measured on real pages."""
    if isinstance(acceptance, list):
        acceptance = {"accepted_length_probs": acceptance}
    kinds = {"accepted_length_probs", "position_acceptance"} & set(acceptance if isinstance(acceptance, dict) else ())
    if len(kinds) != 1 or not isinstance(acceptance[next(iter(kinds))], list):
        raise ValueError("an acceptance description is {\"accepted_length_probs\": [...]} or "
                         "{\"position_acceptance\": [...]} (or a bare list of accepted-length probabilities, or "
                         "the summary.json of `ocriaquant parse --spec K`)")
    kind = kinds.pop()
    vals = acceptance[kind]
    vals = [float(v) for v in vals]
    if not vals or any(not 0 <= v <= 1 for v in vals):
        raise ValueError(f"{kind}: probabilities in [0, 1], at least one; got {vals}")
    if kind == "position_acceptance":
        probs, alive = [], 1.0
        for j in range(k):
            a = vals[j] if j < len(vals) else 0.0
            probs.append(alive * (1 - a))
            alive *= a
        return probs + [alive]
    if abs(sum(vals) - 1) > 1e-3:
        raise ValueError(f"accepted_length_probs must sum to 1, got {sum(vals):.4f}")
    vals += [0.0] * (k + 1 - len(vals))
    return vals[:k] + [sum(vals[k:])]
