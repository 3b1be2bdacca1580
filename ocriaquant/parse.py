"""`ocriaquant parse`: pages in, one markdown file per page out, through our runtime.

A page that cannot be read is reported in the summary and skipped; the others still
complete. Every file is written atomically (temporary name + rename), so an interrupted run
leaves only whole files, and a rerun skips pages whose markdown already exists unless asked
to redo them."""

from __future__ import annotations

import time
from pathlib import Path

from .errors import OcriaError
from .files import write_json_atomic, write_text_atomic


def parse(checkpoint, pages, out, device: str = "cpu", max_new_tokens: int = 1024, max_batch: int = 8,
          redo: bool = False, console=None, backend: str = "torch", tiles=None) -> dict:
    """tiles: a GEMV tile table file for the triton backend (default: recipes/tiles/h200.json)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .data import load_pages
    from .model.load import resolve_model_dir
    from .runtime.config import RuntimeConfig
    from .runtime.engine import Engine
    from .runtime.tiles import TileTable

    # The checkpoint first, before any page is read: a folder of pages given as the checkpoint
    # (`ocriaquant parse my_pages/`) is refused at once, weights missing too.
    resolve_model_dir(checkpoint)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OcriaError(f"{out}: exists and is not a directory")
    report = load_pages(Path(pages), skip_bad=True)  # no readable page at all is an error there
    out.mkdir(parents=True, exist_ok=True)
    todo = [p for p in report.pages if redo or not (out / f"{Path(p.name).stem}.md").exists()]
    t0 = time.time()
    engine = Engine(checkpoint, RuntimeConfig(backend=backend, device=device, max_slots=max_batch,
                                              tiles=TileTable.load(tiles) if tiles else None))
    load_s = time.time() - t0
    tokens = 0
    t1 = time.time()
    with Progress(TextColumn("parsing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, redirect_stdout=False, redirect_stderr=False) as bar:
        task = bar.add_task("pages", total=len(todo))
        encoded = (engine.encode(p) for p in todo)
        for res in engine.generate(encoded, max_new_tokens=max_new_tokens, max_batch=max_batch):
            write_text_atomic(out / f"{Path(todo[res.rid].name).stem}.md", res.text + "\n")
            tokens += len(res.tokens)
            bar.advance(task)
    secs = time.time() - t1
    summary = {"checkpoint": str(checkpoint) if checkpoint else "bundled model", "pages": len(report.pages),
               "parsed": len(todo), "already_done": len(report.pages) - len(todo),
               "failed": [{"path": str(path), "error": err} for path, err in report.bad],
               "tokens": tokens, "seconds": round(secs, 2), "load_seconds": round(load_s, 2),
               "tokens_per_s": round(tokens / secs, 1) if secs > 0 else None, "device": device, "backend": backend}
    write_json_atomic(out / "summary.json", summary)
    return summary
