"""`ocriaquant eval`: decode pages with ground truth and report NED / CER with confidence intervals."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .data import BUNDLED_PAGES, load_pages, select_split
from .errors import OcriaError
from .eval import bootstrap_mean, cer, exact_match, ned
from .files import write_json_atomic
from .model import load_model
from .model.generate import greedy_decode


@dataclass(frozen=True)
class EvalOptions:
    split: str = "heldout"         # heldout, calibration or all
    dtype: str = "bf16"
    device: str = "cpu"
    batch_size: int = 16           # pages decoded together
    max_new_tokens: int = 512      # longest markdown, in tokens
    max_pages: int | None = None   # None: every page of the split
    skip_bad: bool = False         # skip unreadable pages instead of failing


WORST_PAGES = 5  # the summary names the pages read worst, worst first


@dataclass
class PageResult:
    name: str
    ned: float
    cer: float
    exact: float
    prediction: str


@dataclass
class EvalReport:
    model: str
    pages: str
    split: str
    dtype: str
    results: list[PageResult]

    def summary(self) -> dict:
        neds = [r.ned for r in self.results]
        ci = bootstrap_mean(neds)
        cer_ci = bootstrap_mean([r.cer for r in self.results])
        worst = sorted(self.results, key=lambda r: -r.ned)[:WORST_PAGES]
        return {"pages": len(self.results), "ned": ci.estimate, "ned_ci": [ci.low, ci.high],
                "cer": cer_ci.estimate, "cer_ci": [cer_ci.low, cer_ci.high],
                "exact_match": sum(r.exact for r in self.results) / len(self.results),
                "worst_page": worst[0].name, "worst_ned": worst[0].ned,
                "worst_pages": [{"page": r.name, "ned": r.ned} for r in worst]}


def evaluate(model: str | Path | None = None, pages: str | Path | None = None, options: EvalOptions | None = None,
             *, console: Console | None = None, **fields) -> EvalReport:
    """Decode the split's pages with ground truth; fields of EvalOptions may also be given by name."""
    opts = replace(options or EvalOptions(), **fields)
    pages_dir = Path(pages) if pages else BUNDLED_PAGES
    report = load_pages(pages_dir, skip_bad=opts.skip_bad)
    chosen = [p for p in select_split(report.pages, opts.split) if p.has_reference]
    if opts.max_pages:
        chosen = chosen[:opts.max_pages]
    if not chosen:
        raise OcriaError(f"{pages_dir}: no {opts.split} pages with ground truth (NAME.md / NAME.txt beside the image)")
    net, proc = load_model(model, dtype=opts.dtype, device=opts.device)
    with Progress(TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True,
                  # what the libraries print goes where logs.quiet sends it, not above the bar
                  redirect_stdout=False, redirect_stderr=False) as bar:
        task = bar.add_task("pages", total=len(chosen))
        preds = greedy_decode(net, proc, chosen, batch_size=opts.batch_size, max_new_tokens=opts.max_new_tokens,
                              on_batch=lambda n: bar.advance(task, n))
    results = [PageResult(p.name, ned(y, p.reference), cer(y, p.reference), exact_match(y, p.reference), y)
               for p, y in zip(chosen, preds)]
    return EvalReport(str(model or "bundled model"), str(pages_dir), opts.split, opts.dtype, results)


def write_report(report: EvalReport, path: Path) -> None:
    write_json_atomic(path, {"model": report.model, "pages": report.pages, "split": report.split,
                             "dtype": report.dtype, "summary": report.summary(),
                             "results": [asdict(r) for r in report.results]})
