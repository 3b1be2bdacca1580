"""The verbs in a row: `ocriaquant quantize` (calibrate -> search -> export) and the
calibration `ocriaquant search` makes first when it is given none.

Not a verb: verbs share artifacts and never import one another, so what chains them lives
here, above them (cli -> pipeline -> verbs). Each step's artifact is kept under one output
directory (calib/, search/, checkpoint/) so a rerun reuses an unchanged calibration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from .artifacts import DEFAULT_CALIBRATION, is_calibration
from .calibrate import CalibrateOptions, calibrate
from .errors import OcriaError
from .export import ExportOptions, export
from .search import SearchOptions, run_search


@dataclass(frozen=True)
class QuantizeOptions:
    search: SearchOptions = field(default_factory=SearchOptions)  # its device also calibrates
    calib_pages: int = 32     # calibration pages
    calib_dtype: str | None = None  # calibration's dtype (None: fp32 on the CPU, bf16 on a GPU)
    export_pages: int = 16    # calibration pages fed to llmcompressor's oneshot
    verify_pages: int = 16    # held-out pages the checkpoint's reload is checked on (0: skip)
    force: bool = False       # replace an existing OUT/checkpoint


@dataclass
class QuantizeResult:
    out: Path
    checkpoint: Path | None   # None: no quantized plan stayed within the tolerance, BF16 is kept
    report: dict
    seconds: dict[str, float]


def default_calibration(console=None) -> Path:
    """ocriaquant-out/calib, made first (default model, bundled pages) where it is missing."""
    if not is_calibration(DEFAULT_CALIBRATION):
        if console is not None:
            console.print(f"no calibration at {DEFAULT_CALIBRATION}: calibrating the default model on the bundled "
                          "pages first")
        calibrate(out=DEFAULT_CALIBRATION, console=console)
    return DEFAULT_CALIBRATION


def quantize(model=None, pages=None, out: str | Path = "ocriaquant-out", options: QuantizeOptions | None = None, *,
             console=None, **fields) -> QuantizeResult:
    """Calibrate, search and export into `out`; fields of QuantizeOptions may also be given by name."""
    opts = replace(options or QuantizeOptions(), **fields)
    out = Path(out)
    ckpt = out / "checkpoint"
    if ckpt.exists() and not opts.force:  # fail before an hour of work, not after
        raise OcriaError(f"{ckpt}: already exists; choose another --out or pass --force to replace it")
    seconds: dict[str, float] = {}
    t = time.time()
    device = opts.search.device
    dtype = opts.calib_dtype or ("fp32" if device == "cpu" else "bf16")
    calibrate(model, pages, out / "calib", CalibrateOptions(max_pages=opts.calib_pages, device=device, dtype=dtype),
              console=console)
    seconds["calibrate"] = time.time() - t
    t = time.time()
    report = run_search(out / "calib", pages, out / "search", opts.search, console=console)
    seconds["search"] = time.time() - t
    if report["chosen"] == "BF16":
        return QuantizeResult(out, None, report, seconds)
    t = time.time()
    export(out / "search" / "plan.json", ckpt, model, pages,
           ExportOptions(max_pages=opts.export_pages, verify_pages=opts.verify_pages, force=opts.force),
           console=console)
    seconds["export"] = time.time() - t
    return QuantizeResult(out, ckpt, report, seconds)
