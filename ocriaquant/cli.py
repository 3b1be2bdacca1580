"""The `ocriaquant` command. Thin: parse options, call one function per verb."""

from __future__ import annotations

import json
import os
from functools import wraps
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .errors import OcriaError
from .logs import LOG_NAME

# before torch: calibrating a 4B model on 4.1 MP pages fragments the caching allocator (22 GB reserved, free
# and unusable when the 80 GB card ran out); expandable segments keep it usable. A user's own setting stays.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

app = typer.Typer(
    name="ocriaquant",
    help="Quantize a Qwen3.5 document-parsing VLM for your own pages, and serve it fast.\n\n"
         "Every verb runs with no arguments on the bundled reference model and pages.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="markdown",  # help paragraphs reflow to the terminal's width; examples are code blocks
)
# Lines are never broken by us (the terminal wraps them): a path or a command stays whole when
# copied or piped. Tables and progress bars still fit the terminal's width.
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)
DEFAULT_OUT = Path("ocriaquant-out")

# search's judging options, which quantize passes on
Peers = Annotated[str, typer.Option(help="Published recipes judged beside ours (ocriaquant/recipes/peers/): all, "
                                         "none, or NAME,NAME (names or YAML files).")]
Objective = Annotated[str, typer.Option(help="latency (the batch-1 decode step) or throughput (pages/s within "
                                             "--slo-p90).")]
SloP90 = Annotated[Optional[float], typer.Option(help="With --objective throughput: the p90 page latency, in seconds, "
                                                      "the pages/s are measured within.")]
Draft = Annotated[str, typer.Option(help="With --spec: the drafter's weights, bf16 or fp8 (the MTP layer's BF16 Linears "
                                       "and the head drafts are scored with, quantized at load: cheaper drafts, never a "
                                       "different output).")]
DraftVocab = Annotated[int, typer.Option(help="With --spec: score drafts over the lowest N token ids only (0: all; the "
                                         "output never changes, only how many drafts are accepted).", min=0)]
Verbose = Annotated[bool, typer.Option(  # every verb takes it; @_verb reads it
    "--verbose", "-v", help=f"Show the libraries' own messages here (transformers, llmcompressor, their progress "
                            f"bars); without it they go to {LOG_NAME} beside the outputs.")]


def _version(value: bool):
    if value:
        from . import __version__

        console.print(f"ocriaquant {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
):
    """Quantize a Qwen3.5 document-parsing VLM for your own pages, and serve it fast."""


def _beside(out: str) -> Callable[[dict], Path]:
    """The log goes in the folder that holds the verb's --out (ocriaquant-out/ by default)."""
    return lambda a: Path(a[out]).parent if a.get(out) is not None else DEFAULT_OUT


def _pages_option_hint(verb: str) -> Callable[[dict, Path], str]:
    return lambda a, pages: (f"pages go in --pages (MODEL first, or none for the bundled model):\n"
                             f"    ocriaquant {verb} --pages {pages}\n    ocriaquant {verb} MODEL --pages {pages}")


def _parse_hint(a: dict, pages: Path) -> str:
    other = a.get("pages")
    if other is not None and (Path(other) / "config.json").is_file():  # the two arguments swapped
        return f"the checkpoint comes first, then the pages:\n    ocriaquant parse {other} {pages}"
    ckpt = DEFAULT_OUT / "checkpoint"
    if (ckpt / "config.json").is_file():
        return f"parse takes the checkpoint first, then the pages:\n    ocriaquant parse {ckpt} {pages}"
    from .model.load import DEFAULT_MODEL

    return (f"parse takes the checkpoint first, then the pages:\n    ocriaquant parse CHECKPOINT {pages}\n"
            f"CHECKPOINT: one from `ocriaquant export`, or a Qwen3.5 model directory such as the bundled "
            f"{DEFAULT_MODEL}")


def _verb(log_dir: Callable[[dict], Path] = lambda a: DEFAULT_OUT, *, model: str | None = None,
          weights: bool = True, hint: Callable[[dict, Path], str] | None = None):
    """Run a verb quietly and turn OcriaError into one line and exit code 2 instead of a traceback.

    Unless --verbose, the libraries' output goes to `log_dir(args)`/ocriaquant.log (logs.quiet).
    `model` names the argument that holds a model directory: it is checked first (a folder, a
    Qwen3.5 config.json and, with `weights`, the weights); a folder of pages there is refused
    with `hint(args, folder)`, the command the user probably meant."""

    def decorate(fn):
        @wraps(fn)
        def run(**a):
            from .logs import quiet

            try:
                with quiet(log_dir(a) / LOG_NAME, title=fn.__name__.rstrip("_"), verbose=a.get("verbose", False),
                           consoles=(console, err_console), note=_note, warn=_warn, done=_logged):
                    if model is not None and a.get(model) is not None:
                        from .model.load import resolve_model_dir  # torch and friends: imported quietly

                        resolve_model_dir(a[model], weights=weights)
                    return fn(**a)
            except OcriaError as e:
                err_console.print(f"[bold red]error:[/] {escape(str(e))}")
                from .model.load import PagesNotModel

                if hint is not None and isinstance(e, PagesNotModel):
                    err_console.print(escape(hint(a, e.path)))
                raise typer.Exit(2) from None

        return run

    return decorate


def _note(text: str) -> None:
    err_console.print(f"[bold]note:[/] {escape(text)}", highlight=False)


def _warn(text: str) -> None:
    err_console.print(f"[yellow]warning:[/] {escape(text)}", highlight=False)


def _logged(log) -> None:
    err_console.print(f"[dim]the libraries' messages are in {escape(str(log.path))} (--verbose shows them here)[/]",
                      highlight=False)


@app.command()
@_verb(model="model", weights=False, hint=_pages_option_hint("info"))
def info(
    model: Annotated[Optional[Path], typer.Argument(help="Local Qwen3.5 model directory (default: bundled model).")] = None,
    shape: Annotated[Optional[str], typer.Option(help="Describe a named shape instead of a directory: "
                                                 "qwen3.5-4b or qwen3.5-0.8b (built on the meta device).")] = None,
    pages: Annotated[Optional[Path], typer.Option(help="Also summarize a page folder (default with no MODEL: "
                                                  "the bundled calib_data/).")] = None,
    by_kind: Annotated[bool, typer.Option("--by-kind", help="One row per group kind instead of per group.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    skip_bad: Annotated[bool, typer.Option("--skip-bad", help="Skip unreadable pages with a warning.")] = False,
    verbose: Verbose = False,
):
    """Show the layer groups of a model, their sizes per format, and bytes per decode step.

    No weights are read: the model is built on the meta device from its config.json (a folder
    whose weights are missing is described, with a warning).

    Examples:

        ocriaquant info
        ocriaquant info ~/models/OCRia-1 --by-kind
        ocriaquant info --shape qwen3.5-4b --json
    """
    from .data import BUNDLED_PAGES
    from .info import model_info, render_info, render_pages, weights_warning

    result = model_info(model, shape)
    warning = weights_warning(result)
    if as_json:
        console.print_json(json.dumps(result.to_json()))
        if warning:
            _warn(warning)
        return
    render_info(result, console, by_kind=by_kind)
    if warning:
        _warn(warning)
    if pages is None and model is None and shape is None and BUNDLED_PAGES.is_dir():
        pages = BUNDLED_PAGES
    if pages is not None:
        render_pages(pages, console, skip_bad=skip_bad)


@app.command()
@_verb(_beside("out"), model="model", hint=_pages_option_hint("calibrate"))
def calibrate(
    model: Annotated[Optional[Path], typer.Argument(help="Local Qwen3.5 model directory (default: bundled model).")] = None,
    pages: Annotated[Optional[Path], typer.Option(help="Your pages: images, PDFs or an imagefolder "
                                                  "(default: bundled calib_data/).")] = None,
    out: Annotated[Path, typer.Option(help="Calibration artifact directory.")] = Path("ocriaquant-out/calib"),
    max_pages: Annotated[int, typer.Option(help="Calibrate on at most this many pages (0: all).")] = 32,
    split: Annotated[str, typer.Option(help="Which pages: calibration (hash split), heldout or all.")] = "calibration",
    batch_size: Annotated[int, typer.Option(help="Pages per forward/backward pass.")] = 4,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="fp32 (CPU default) or bf16.")] = "fp32",
    skip_bad: Annotated[bool, typer.Option("--skip-bad", help="Skip unreadable pages with a warning.")] = False,
    verbose: Verbose = False,
):
    """Measure how much each layer group suffers in FP8 or NVFP4 on your pages.

    Records how your pages look inside the model (activation statistics) and each group's
    sensitivity on H200 (NVFP4 weight-only) and B200 (NVFP4 W4A4) numerics. Pages are
    teacher-forced on their ground truth (NAME.md beside the image) or on the model's own
    output. The artifact (OUT/meta.json, stats.safetensors, sensitivity.json) is reused when
    model, pages and settings are unchanged; an interrupted run resumes.
    """
    from .calibrate import CalibrateOptions, calibrate as run

    opts = CalibrateOptions(max_pages=max_pages or None, split=split, batch_size=batch_size, device=device, dtype=dtype,
                            skip_bad=skip_bad)
    res = run(model, pages, out, opts, console=err_console)
    if not res.reused:
        console.print(f"calibrated on {res.pages} pages in {res.seconds:.1f}s -> {res.out}")


@app.command()
@_verb(_beside("out"))
def search(
    calib: Annotated[Optional[Path], typer.Argument(help="Calibration artifact (default: ocriaquant-out/calib, "
                                                    "made first if missing).")] = None,
    pages: Annotated[Optional[Path], typer.Option(help="Pages whose held-out split judges candidates "
                                                  "(default: the calibration's page folder).")] = None,
    out: Annotated[Path, typer.Option(help="Where plan.json, report.md/json and pareto.png go.")] = Path("ocriaquant-out/search"),
    target: Annotated[str, typer.Option(help="h200 (NVFP4 weight-only, FP8 W8A8) or b200 (NVFP4 W4A4).")] = "h200",
    batch: Annotated[int, typer.Option(help="The batch you serve at: step time predicted, and measured, there.")] = 1,
    max_ned_increase: Annotated[float, typer.Option(help="Tolerance: the chosen plan's NED increase over BF16, "
                                                    "95% upper bound.")] = 0.01,
    policy: Annotated[Optional[Path], typer.Option(help="Search-space YAML (default: "
                                                   "ocriaquant/recipes/default.yaml).")] = None,
    latency_table: Annotated[Optional[Path], typer.Option(help="Measured latencies from benchmarks/bench_kernels.py.")] = None,
    eval_pages: Annotated[int, typer.Option(help="Held-out pages with ground truth decoded per candidate (all of "
                                            "them, up to this many).")] = 256,
    candidates: Annotated[int, typer.Option(help="Frontier points evaluated besides BF16/FP8/NVFP4.")] = 4,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Compute dtype of the runtime that decodes the held-out pages.")] = "bf16",
    max_new_tokens: Annotated[Optional[int], typer.Option(help="Cap on decoded tokens per page (below it, each page "
                                                          "has room for 1.25x its reference + 16).")] = None,
    peers: Peers = "all",
    objective: Objective = "latency",
    slo_p90: SloP90 = None,
    measure: Annotated[Optional[bool], typer.Option("--measure/--no-measure", help="Time the finalists in the "
                                                    "runtime (default: on a GPU yes, on the CPU no).")] = None,
    verbose: Verbose = False,
):
    """Choose a format per layer group: the fastest plan within your quality tolerance.

    The plan's parsing quality on held-out pages stays within the tolerance (NED increase over
    BF16, 95% upper bound); the Pareto frontier and the evidence go in a report. plan.json
    names the model and calibration relative to its own folder: move them together, or give
    `ocriaquant export` the model with --model. Each candidate's outputs go to --out's candidates/
    as they are decoded: a killed search resumes there, and a rerun with another tolerance
    re-ranks without decoding (delete candidates/ to decode again).
    """
    from .pipeline import default_calibration
    from .search import SearchOptions, run_search

    opts = SearchOptions(target=target, batch=batch, max_ned_increase=max_ned_increase, policy=policy,
                         latency_table=latency_table, eval_pages=eval_pages, candidates=candidates, device=device,
                         dtype=dtype, max_new_tokens=max_new_tokens, peers=peers, objective=objective,
                         slo_p90=slo_p90, measure=measure)
    rep = run_search(calib or default_calibration(err_console), pages, out, opts, console=err_console)
    console.print(f"[bold]{rep['chosen']}[/]: {rep['verdict']}")
    for c in rep["candidates"]:
        m = c["measured"]
        timed = f"  measured {m['step_b1_ms']:.3f} ms" if m else ""
        console.print(f"  {c['label']:<26} {c['target']}  predicted {c['predicted_b1_ms']:.4f} ms{timed}  "
                      f"NED {c['ned']:.4f}  ΔNED {c['ned_increase'][0]:+.4f} (≤{c['ned_increase'][2]:+.4f})")
    console.print(f"wrote {out}/plan.json, report.md, report.json, pareto.png")


@app.command()
@_verb(_beside("out"), model="model",
       hint=lambda a, pages: f"--model takes the model directory; the pages for oneshot go in --pages {pages}")
def export(
    plan: Annotated[Path, typer.Argument(help="plan.json from `ocriaquant search`.")] = Path("ocriaquant-out/search/plan.json"),
    out: Annotated[Path, typer.Option(help="Checkpoint directory to create.")] = Path("ocriaquant-out/checkpoint"),
    model: Annotated[Optional[Path], typer.Option(help="Model directory (default: the one the plan names; "
                                                  "any copy of the model the plan was calibrated on, checked "
                                                  "by its fingerprint).")] = None,
    pages: Annotated[Optional[Path], typer.Option(help="Pages for llmcompressor's observers (calibration split; "
                                                  "default: bundled calib_data/).")] = None,
    max_pages: Annotated[int, typer.Option(help="Calibration pages fed to oneshot.")] = 16,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out (only once the new "
                                        "checkpoint is complete).")] = False,
    verify_pages: Annotated[int, typer.Option(help="Held-out pages on which the reloaded checkpoint is compared "
                                              "token for token with search's simulation (0: skip).")] = 16,
    recipe: Annotated[Optional[str], typer.Option(help="Export a published recipe as it stands instead of PLAN: a name "
                                                  "from ocriaquant/recipes/peers/ (e.g. llmcompressor-nvfp4) or a YAML "
                                                  "file.")] = None,
    target: Annotated[str, typer.Option(help="With --recipe: h200 (NVFP4 weight-only) or b200 (NVFP4 W4A4).")] = "h200",
    verbose: Verbose = False,
):
    """Write the plan as a mixed-precision compressed-tensors checkpoint.

    llmcompressor oneshot, one NVFP4 global scale per fused unit; with the processor files,
    recipe.yaml and ocriaquant.json. Written to a temporary directory and renamed at the end:
    a failure leaves no partial --out. Tensors transformers does not load (mtp.*) are carried
    over untouched. Then the checkpoint is reloaded with transformers and checked against
    search's simulation of the plan.
    """
    from .export import ExportOptions, export as run

    opts = ExportOptions(max_pages=max_pages, verify_pages=verify_pages, force=force)
    if recipe:
        import tempfile

        from .peers import save_recipe_plan

        with tempfile.TemporaryDirectory() as tmp:  # the recipe's plan, for this model
            plan = Path(tmp) / "plan.json"
            save_recipe_plan(recipe, plan, model, target)
            path = run(plan, out, model, pages, opts, console=err_console)
    else:
        path = run(plan, out, model, pages, opts, console=err_console)
    console.print(f"wrote {path}")


@app.command()
@_verb(lambda a: Path(a["out"]), model="model", hint=_pages_option_hint("quantize"))
def quantize(
    model: Annotated[Optional[Path], typer.Argument(help="Local Qwen3.5 model directory (default: bundled model).")] = None,
    pages: Annotated[Optional[Path], typer.Option(help="Your pages (default: bundled calib_data/): the calibration "
                                                  "split calibrates, the held-out split judges.")] = None,
    out: Annotated[Path, typer.Option(help="Directory for calib/, search/ and checkpoint/.")] = Path("ocriaquant-out"),
    target: Annotated[str, typer.Option(help="h200 (NVFP4 weight-only, FP8 W8A8) or b200 (NVFP4 W4A4).")] = "h200",
    batch: Annotated[int, typer.Option(help="The batch you serve at: step time predicted, and measured, there.")] = 1,
    max_ned_increase: Annotated[float, typer.Option(help="Tolerated NED increase over BF16 (95% upper bound).")] = 0.01,
    policy: Annotated[Optional[Path], typer.Option(help="Search-space YAML (default: "
                                                   "ocriaquant/recipes/default.yaml).")] = None,
    latency_table: Annotated[Optional[Path], typer.Option(help="Measured latencies from benchmarks/bench_kernels.py.")] = None,
    calib_pages: Annotated[int, typer.Option(help="Calibration pages.")] = 32,
    eval_pages: Annotated[int, typer.Option(help="Held-out pages with ground truth decoded per search candidate "
                                            "(all of them, up to this many).")] = 256,
    verify_pages: Annotated[int, typer.Option(help="Held-out pages for the checkpoint's reload check (0: skip).")] = 16,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing OUT/checkpoint.")] = False,
    peers: Peers = "all",
    objective: Objective = "latency",
    slo_p90: SloP90 = None,
    measure: Annotated[Optional[bool], typer.Option("--measure/--no-measure", help="Time the search's finalists in "
                                                    "the runtime (default: on a GPU yes, on the CPU no).")] = None,
    verbose: Verbose = False,
):
    """Calibrate, search and export in one go: the fastest checkpoint within your tolerance.

    The checkpoint's quality on your held-out pages stays within the tolerance. Each step's
    artifact stays in OUT (calib/, search/, checkpoint/); a rerun reuses an unchanged
    calibration. If no quantized plan stays within the tolerance, BF16 is kept and nothing is
    exported.

    Examples:

        ocriaquant quantize
        ocriaquant quantize ~/models/OCRia-1 --pages ~/my-pages --target b200
        ocriaquant quantize --max-ned-increase 0.02 --out ocriaquant-out-2pct
    """
    from .pipeline import QuantizeOptions, quantize as run
    from .search import SearchOptions

    # quantize has no --dtype: calibration runs in fp32 on the CPU, bf16 on a GPU (QuantizeOptions.calib_dtype);
    # search decodes in bf16, as the checkpoint is served.
    search_opts = SearchOptions(target=target, batch=batch, max_ned_increase=max_ned_increase, policy=policy,
                                latency_table=latency_table, eval_pages=eval_pages, device=device, peers=peers,
                                objective=objective, slo_p90=slo_p90, measure=measure)
    opts = QuantizeOptions(search=search_opts, calib_pages=calib_pages, verify_pages=verify_pages, force=force)
    res = run(model, pages, out, opts, console=err_console)
    console.print(f"[bold]{res.report['chosen']}[/]: {res.report['verdict']}")
    times = ", ".join(f"{k} {v:.0f}s" for k, v in res.seconds.items())
    if res.checkpoint is None:
        console.print(f"kept BF16; nothing exported ({times}). Report: {res.out}/search/report.md")
        return
    meta = json.loads((res.checkpoint / "ocriaquant.json").read_text())
    v = meta.get("verification")
    if v:
        console.print(f"reload check: {v['identical_pages']}/{v['pages']} held-out pages token-identical "
                      "with search's simulation")
    console.print(f"wrote {res.checkpoint} ({times}); report: {res.out}/search/report.md")


@app.command()
@_verb(_beside("out"), model="checkpoint", hint=_parse_hint)
def parse(
    checkpoint: Annotated[Optional[Path], typer.Argument(help="Checkpoint from `ocriaquant export` or a BF16 "
                                                         "Qwen3.5 model directory (default: bundled model).")] = None,
    pages: Annotated[Optional[str], typer.Argument(help="Folder of pages or PDFs, a single file, or any path fsspec "
                                                   "reads, e.g. s3://bucket/scans (default: bundled calib_data/).")] = None,
    out: Annotated[Path, typer.Option(help="Directory for NAME.md per page and summary.json.")] = Path("ocriaquant-out/parsed"),
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda (default: cpu; cuda with --gpus or --ray).")] = None,
    max_batch: Annotated[int, typer.Option(help="Pages decoded together (continuous batching), per engine.")] = 8,
    max_new_tokens: Annotated[int, typer.Option(help="Longest markdown, in tokens.")] = 1024,
    redo: Annotated[bool, typer.Option("--redo", help="Parse again pages whose NAME.md already exists.")] = False,
    backend: Annotated[str, typer.Option(help="torch (reference, CPU or GPU) or triton (decode kernels; GPU, or "
                                         "the CPU under TRITON_INTERPRET=1).")] = "torch",
    tiles: Annotated[Optional[Path], typer.Option(help="GEMV tile table for the triton backend (default: "
                                                  "ocriaquant/recipes/tiles/h200.json, swept on an H200).")] = None,
    gpus: Annotated[Optional[str], typer.Option(help="One engine per GPU: `all` or a number. With --device cpu, that "
                                                "many CPU engine workers (a dry run of the same code).")] = None,
    ray: Annotated[Optional[str], typer.Option(
        "--ray", metavar="ADDRESS",
        help="Run the engines as actors of a Ray cluster (Ray Data): `--ray auto` joins the cluster this machine "
             "belongs to (`ray start`), `--ray ray://HEAD:10001` another one, `--ray local` starts Ray here. Needs "
             "`pip install ocriaquant[scale]`.")] = None,
    read_workers: Annotated[Optional[int], typer.Option(
        help="Processes per engine that read, render and preprocess pages ahead of it (0: in the engine's own "
             "process; default 2 on a GPU, 0 on the CPU, where the engine needs the cores).")] = None,
    spec: Annotated[int, typer.Option(help="Speculative decoding: tokens the checkpoint's MTP layer drafts per step "
                                      "(0: off). Output is identical to --spec 0 (greedy); summary.json gives the "
                                      "accepted length.", min=0, max=8)] = 0,
    draft: Draft = "bf16",
    draft_vocab: DraftVocab = 0,
    verbose: Verbose = False,
):
    """Parse pages to markdown with ocriaquant's own runtime.

    Pages are read, rendered and preprocessed ahead of the engine by reader processes, so memory
    stays flat whatever the folder's size. Unreadable pages are reported in summary.json and
    skipped; the others complete. Files are written atomically; a rerun skips pages already parsed
    (--redo to parse them again). With --gpus, each GPU runs its own engine on a share of the
    pages; a worker that dies loses only the pages it held (summary.json names them; rerun the
    same command to parse them).

    Examples:

        ocriaquant parse ocriaquant-out/checkpoint ~/scans --out parsed/
        ocriaquant parse --device cuda --max-batch 32 ckpt/ pages/
        ocriaquant parse ckpt/ ~/backlog --gpus all --backend triton --max-batch 32
        ocriaquant parse ckpt/ s3://bucket/backlog --ray auto --backend triton
        ocriaquant parse ckpt/ pages/ --spec 4      (drafts with the checkpoint's MTP layer)
        ocriaquant parse ckpt/ pages/ --spec 3 --draft fp8 --draft-vocab 32768   (cheaper drafts)
    """
    from .data import BUNDLED_PAGES
    from .parse import ParseOptions, parse as run

    device = device or ("cuda" if gpus is not None or ray is not None else "cpu")
    opts = ParseOptions(device=device, backend=backend, max_new_tokens=max_new_tokens, max_batch=max_batch,
                        redo=redo, tiles=tiles, read_workers=read_workers, gpus=gpus, ray=ray, spec=spec,
                        draft=draft, draft_vocab=draft_vocab)
    s = run(checkpoint, pages or BUNDLED_PAGES, out, opts, err_console)
    console.print(f"parsed {s['parsed']} of {s['pages']} pages ({s['already_done']} already done) in "
                  f"{s['seconds']:.1f}s, {s['tokens']} tokens ({s['tokens_per_s']} tok/s) -> {out}")
    if spec:
        console.print(f"speculative decoding, {spec} drafts a step: {s['accepted_length']} tokens per verify step")
    for f in s["failed"]:
        console.print(f"[yellow]skipped[/] {escape(f['path'])}: {escape(f['error'])}")
    for w in s.get("workers", []):
        if w["exit_code"] != 0:
            console.print(f"[red]engine worker {w['worker']} ({w['device']}) died[/] (exit code {w['exit_code']}"
                          f"{': ' + escape(w['error']) if w.get('error') else ''}); pages it held, not parsed: "
                          f"{', '.join(w['lost']) or 'none'}")
    if s.get("lost") or s.get("not_started"):
        console.print(f"{len(s['lost']) + s.get('not_started', 0)} page(s) not parsed; run the same command again "
                      "to parse them (finished pages are skipped)")
        raise typer.Exit(1)


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise OcriaError(f"{what} must be comma-separated integers, e.g. 1,8,32,64; got {text!r}") from None
    if not vals or min(vals) < 1:
        raise OcriaError(f"{what} must be positive integers, got {text!r}")
    return vals


@app.command()
@_verb(_beside("out"), model="checkpoint",
       hint=lambda a, pages: "bench times a checkpoint on synthetic pages:  ocriaquant bench CHECKPOINT")
def bench(
    checkpoint: Annotated[Optional[Path], typer.Argument(help="Checkpoint or BF16 model directory (default: the "
                                                         "bundled model, unless --shape).")] = None,
    shape: Annotated[Optional[str], typer.Option(help="Bench a named shape with random weights instead: "
                                                 "qwen3.5-4b or qwen3.5-0.8b.")] = None,
    plan: Annotated[str, typer.Option(help="With --shape: bf16; mixed (NVFP4 MLPs, FP8 GDN and attention, "
                                      "BF16 head); fp8 or nvfp4 (every decoder Linear, BF16 head).")] = "mixed",
    device: Annotated[str, typer.Option(help="cuda (or cpu with --backend torch, slowly).")] = "cuda",
    backend: Annotated[str, typer.Option(help="triton (our kernels + CUDA graphs) or torch (reference).")] = "triton",
    batches: Annotated[str, typer.Option(help="Decode batch sizes.")] = "1,8,32,64",
    context: Annotated[int, typer.Option(help="Tokens already cached per row when decode speed is measured.")] = 512,
    steps: Annotated[int, typer.Option(help="Decode steps timed per batch size.")] = 32,
    concurrency: Annotated[str, typer.Option(help="Page concurrency levels (empty: skip pages).")] = "1,8,32,64",
    pages: Annotated[Optional[int], typer.Option(help="Pages per concurrency level (default max(4, level)).")] = None,
    megapixels: Annotated[float, typer.Option(help="Size of the synthetic pages.")] = 4.1,
    out_tokens: Annotated[int, typer.Option(help="Tokens generated per page (EOS ignored).")] = 1000,
    baseline: Annotated[bool, typer.Option(help="Also time transformers generate on the same weights.")] = True,
    baseline_tokens: Annotated[int, typer.Option(help="Decode steps timed for transformers.")] = 16,
    cuda_graphs: Annotated[bool, typer.Option(help="Replay the decode step as a CUDA graph per batch bucket.")] = True,
    tiles: Annotated[Optional[Path], typer.Option(help="GEMV tile table for the triton backend (default: "
                                                  "ocriaquant/recipes/tiles/h200.json, swept on an H200).")] = None,
    slo_p90: Annotated[Optional[float], typer.Option(help="Also find the highest concurrency whose p90 page "
                                                     "latency stays within this many seconds, and its pages/s.")] = None,
    prefill_budget: Annotated[Optional[int], typer.Option(help="Prompt tokens the engine prefills per step, beside "
                                                          "the decode rows (chunked prefill; default: the engine's, "
                                                          "about one 4.1 MP page).", min=1)] = None,
    gpus: Annotated[Optional[str], typer.Option(help="Pages/s and p50/p90 with one engine per GPU (`all` or N), "
                                                "at the largest --concurrency per GPU, on 1 GPU and on N in the same "
                                                "run, and the scaling efficiency; decode rows are not timed.")] = None,
    spec: Annotated[int, typer.Option(help="Also time speculative decoding with this many MTP drafts a step (the "
                                      "checkpoint's MTP layer; a --shape gets a random one).", min=0, max=8)] = 0,
    acceptance: Annotated[Optional[Path], typer.Option(help="With --spec: JSON acceptance to expect, "
                                                       "{\"accepted_length_probs\": [P(1 token), P(2), ...]} or "
                                                       "{\"position_acceptance\": [a1, a2, ...]}, or the summary.json "
                                                       "of `ocriaquant parse --spec K` (measured on your pages); "
                                                       "needed with --shape "
                                                       "(random weights accept nothing: each step's rows then accept "
                                                       "as drawn from it, the costs real). The report says it was "
                                                       "given, not measured.")] = None,
    draft: Draft = "bf16",
    draft_vocab: DraftVocab = 0,
    out: Annotated[Path, typer.Option(help="JSON report, rewritten as each figure comes in (marked "
                                           "\"partial\" until the run ends).")] = Path("ocriaquant-out/bench.json"),
    verbose: Verbose = False,
):
    """Measure the runtime's speed, with transformers beside it, in one run.

    Decode tok/s per batch, pages/s and p50/p90 latency per concurrency, the roofline ratio, and
    transformers `generate` on the same weights. Decode rows start from `--context` cached
    tokens; the roofline is the bytes one step moves (weights as our kernels read them, GDN
    state, KV cache) over the copy bandwidth measured in the same run. Pages are synthetic,
    vision encoder and prefill included. On a GPU, one page's prefill is also timed against its
    FLOP roofline; `--slo-p90 10` finds the highest concurrency whose p90 latency holds 10 s.
    With `--spec K` the pages are served both ways, plain decoding and speculative.

    Examples:

        ocriaquant bench --shape qwen3.5-4b --plan mixed
        ocriaquant bench --shape qwen3.5-4b --batches 1,64 --concurrency "" --slo-p90 10
        ocriaquant bench ocriaquant-out/checkpoint --batches 1,8 --concurrency 8
        ocriaquant bench --shape qwen3.5-4b --spec 3 --acceptance benchmarks/acceptance_mean3_k3.json --draft fp8
        ocriaquant bench --shape qwen3.5-4b --gpus all --concurrency 32
    """
    from .bench import BenchOptions, gpus_table, run, run_gpus, table
    from .files import write_json_atomic

    opts = BenchOptions(shape=shape, plan=plan, device=device, backend=backend,
                        batches=tuple(_ints(batches, "--batches")), context=context, steps=steps,
                        concurrency=tuple(_ints(concurrency, "--concurrency")) if concurrency.strip() else (),
                        pages=pages, megapixels=megapixels, out_tokens=out_tokens, baseline=baseline,
                        baseline_tokens=baseline_tokens, cuda_graphs=cuda_graphs, tiles=tiles, slo_p90=slo_p90,
                        prefill_budget=prefill_budget, spec=spec, acceptance=acceptance, draft=draft,
                        draft_vocab=draft_vocab)
    log = lambda m: err_console.print(f"[dim]{m}[/]")  # noqa: E731
    if gpus is not None:
        rep = run_gpus(checkpoint, gpus, opts, log=log)
        console.print(gpus_table(rep))
    else:
        rep = run(checkpoint, opts, log=log, save=lambda r: write_json_atomic(out, r))  # a cut run keeps its rows
        for t in table(rep):
            console.print(t)
    write_json_atomic(out, rep)
    console.print(f"wrote {out}")


@app.command("eval")
@_verb(_beside("out"), model="model", hint=_pages_option_hint("eval"))
def eval_(
    model: Annotated[Optional[Path], typer.Argument(help="Model or checkpoint directory (default: bundled model).")] = None,
    pages: Annotated[Optional[Path], typer.Option(help="Pages with ground truth (default: bundled calib_data/).")] = None,
    split: Annotated[str, typer.Option(help="heldout, calibration or all.")] = "heldout",
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32.")] = "bf16",
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    batch_size: Annotated[int, typer.Option(help="Pages decoded together.")] = 16,
    max_new_tokens: Annotated[int, typer.Option(help="Longest markdown, in tokens.")] = 512,
    max_pages: Annotated[Optional[int], typer.Option(help="Evaluate only the first N pages.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Write per-page results and the summary as JSON.")] = None,
    skip_bad: Annotated[bool, typer.Option("--skip-bad", help="Skip unreadable pages with a warning.")] = False,
    verbose: Verbose = False,
):
    """Greedy-decode pages and score them against their ground truth.

    Prints the mean normalized edit distance (NED) with a 95% bootstrap interval, CER, exact
    match and the worst pages. With no arguments: the bundled model on the bundled held-out pages.
    """
    from .evaluate import EvalOptions, evaluate, write_report

    opts = EvalOptions(split=split, dtype=dtype, device=device, batch_size=batch_size, max_new_tokens=max_new_tokens,
                       max_pages=max_pages, skip_bad=skip_bad)
    rep = evaluate(model, pages, opts, console=console)
    s = rep.summary()
    console.print(f"[bold]{rep.model}[/] on {s['pages']} pages ({split} split) of {rep.pages} ({dtype}):")
    console.print(f"  NED {s['ned']:.4f}  95% CI [{s['ned_ci'][0]:.4f}, {s['ned_ci'][1]:.4f}]")
    console.print(f"  CER {s['cer']:.4f}  exact match {s['exact_match']:.1%}")
    console.print("  worst pages: " + ", ".join(f"{w['page']} {w['ned']:.4f}" for w in s["worst_pages"]))
    if out:
        write_report(rep, out)
        console.print(f"wrote {out}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
