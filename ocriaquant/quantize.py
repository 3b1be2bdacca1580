"""`ocriaquant quantize`: calibrate -> search -> export in one go, each step's artifact kept
under one output directory (calib/, search/, checkpoint/) so a rerun reuses what is done."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from .errors import OcriaError


@dataclass
class QuantizeResult:
    out: Path
    checkpoint: Path | None
    report: dict
    seconds: dict[str, float]


def quantize(model=None, pages=None, out="ocriaquant-out", target: str = "h200", batch: int = 1,
             max_ned_increase: float = 0.01, policy=None, latency_table=None, calib_pages: int = 32,
             eval_pages: int = 16, candidates: int = 4, export_pages: int = 16, verify_pages: int = 16,
             device: str = "cpu", force: bool = False, console=None) -> QuantizeResult:
    from .calibrate import calibrate
    from .export import export
    from .search import run_search

    out = Path(out)
    ckpt = out / "checkpoint"
    if ckpt.exists() and not force:  # fail before an hour of work, not after
        raise OcriaError(f"{ckpt}: already exists; choose another --out or pass --force to replace it")
    seconds: dict[str, float] = {}
    t = time.time()
    dtype = "fp32" if device == "cpu" else "bf16"
    calibrate(model, pages, out / "calib", calib_pages, device=device, dtype=dtype, console=console)
    seconds["calibrate"] = time.time() - t
    t = time.time()
    report = run_search(out / "calib", pages, out / "search", target, batch, max_ned_increase, policy,
                        latency_table, eval_pages, candidates, device, dtype, console=console)
    seconds["search"] = time.time() - t
    if report["chosen"] == "BF16":
        return QuantizeResult(out, None, report, seconds)
    t = time.time()
    export(out / "search" / "plan.json", ckpt, model, pages, force, export_pages, console, verify_pages)
    seconds["export"] = time.time() - t
    return QuantizeResult(out, ckpt, report, seconds)
