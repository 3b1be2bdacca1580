"""The `ocriaquant` command. Thin: parse options, call one function per verb."""

from __future__ import annotations

import json
from functools import wraps
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from .errors import OcriaError

app = typer.Typer(
    name="ocriaquant",
    help="Quantize a Qwen3.5 document-parsing VLM for your own pages, and serve it fast.\n\n"
         "Every verb runs with no arguments on the bundled reference model and pages.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
console = Console()
err_console = Console(stderr=True)


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


def _friendly(fn):
    """Turn OcriaError into a one-line message and exit code 2 instead of a traceback."""

    @wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OcriaError as e:
            err_console.print(f"[bold red]error:[/] {e}")
            raise typer.Exit(2) from None

    return run


@app.command()
@_friendly
def info(
    model: Annotated[Optional[Path], typer.Argument(help="Local Qwen3.5 model directory (default: bundled model).")] = None,
    shape: Annotated[Optional[str], typer.Option(help="Describe a named shape instead of a directory: "
                                                 "qwen3.5-4b or qwen3.5-0.8b (built on the meta device).")] = None,
    pages: Annotated[Optional[Path], typer.Option(help="Also summarize a page folder (default with no MODEL: "
                                                  "the bundled calib_data/).")] = None,
    by_kind: Annotated[bool, typer.Option("--by-kind", help="One row per group kind instead of per group.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    skip_bad: Annotated[bool, typer.Option("--skip-bad", help="Skip unreadable pages with a warning.")] = False,
):
    """Show the layer groups of a model, their sizes per format, and bytes per decode step.

    No weights are read: the model is built on the meta device from its config.json.

    Examples:\n
      ocriaquant info\n
      ocriaquant info ~/models/OCRia-1 --by-kind\n
      ocriaquant info --shape qwen3.5-4b --json
    """
    from .data import BUNDLED_PAGES
    from .info import model_info, render_info, render_pages

    result = model_info(model, shape)
    if as_json:
        console.print_json(json.dumps(result.to_json()))
        return
    render_info(result, console, by_kind=by_kind)
    if pages is None and model is None and shape is None and BUNDLED_PAGES.is_dir():
        pages = BUNDLED_PAGES
    if pages is not None:
        render_pages(pages, console, skip_bad=skip_bad)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
