"""`ocriaquant parse`: pages in, one markdown file per page out, through our runtime.

Pages are listed without their pixels, then read, rendered and preprocessed by reader processes
ahead of the engine (data/stream.py), so memory stays flat whatever the folder's size. A page
that cannot be read is reported in the summary and skipped; the others still complete. Every
file is written atomically (temporary name + rename), so an interrupted run leaves only whole
files, and a rerun skips pages whose markdown already exists unless asked to redo them.

One engine in this process, or (`gpus`) one engine process per GPU on this host pulling shards
of the pages (scale/pool.py), or (`ray`) one engine actor per GPU of a Ray cluster
(scale/ray_data.py). All three write the same files: NAME.md per page, summary.json.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from .errors import OcriaError
from .files import write_json_atomic, write_text_atomic

# Pages per shard handed to an engine worker: consecutive pages (a PDF's stay together); a worker
# that dies loses at most its shard and what it had admitted.
SHARD_PAGES = 4


@dataclass(frozen=True)
class ParseOptions:
    """How `ocriaquant parse` runs (the CLI's flags)."""
    device: str = "cpu"
    backend: str = "torch"
    max_new_tokens: int = 1024
    max_batch: int = 8
    redo: bool = False
    tiles: Path | None = None       # GEMV tile table for the triton backend
    dpi: int = 150                  # PDF pages rendered at
    read_workers: int | None = None  # page reader processes per engine; None: 2 on a GPU, 0 (inline) on the CPU
    read_ahead: int = 4             # encoded pages waiting for the engine, at most, beyond one per reader
    spec: int = 0                   # speculative decoding: draft tokens per step from the checkpoint's MTP (#55)
    draft: str = "bf16"             # with spec: the drafter's weights (RuntimeConfig.draft)
    draft_vocab: int = 0            # with spec: drafts over the lowest N token ids (0: all)
    gpus: str | int | None = None   # None: one engine here; N or "all": one engine process per device
    ray: str | None = None          # a Ray address ("auto", "ray://head:10001") or "local": engines as Ray actors


@dataclass(frozen=True)
class _Job:
    """What an engine worker needs (pickled to each one)."""
    model_dir: Path
    out: Path
    options: ParseOptions


def markdown_name(page_name: str) -> str:
    """NAME.md for a page: the image's stem, or for a PDF page STEM.pN (the sidecar convention)."""
    base, _, pdf_page = page_name.partition("#")
    return f"{Path(base).stem}.{pdf_page}.md" if pdf_page else f"{Path(base).stem}.md"


def build_engine(model_dir: Path, device: str, o: ParseOptions):
    from .runtime.config import RuntimeConfig
    from .runtime.engine import Engine
    from .runtime.tiles import TileTable

    return Engine(model_dir, RuntimeConfig(backend=o.backend, device=device, max_slots=o.max_batch,
                                           tiles=TileTable.load(o.tiles) if o.tiles else None, spec=o.spec,
                                           draft=o.draft, draft_vocab=o.draft_vocab))


def parse_refs(engine, device: str, refs, job: _Job, emit: Callable[..., None]) -> None:
    """Parse the pages `refs` (pulled lazily) with `engine`: readers encode ahead, the engine
    decodes, each page's markdown is written as it finishes. emit("done"|"failed", key=name, …)."""
    from .data.stream import stream_pages
    from .model.processor import PageEncoder

    o = job.options
    # On the CPU the engine needs the cores the readers would take: there, pages are read inline.
    readers = o.read_workers if o.read_workers is not None else (0 if str(device).startswith("cpu") else 2)
    stream = stream_pages(refs, PageEncoder(job.model_dir, engine.runner.model.dtype), workers=readers,
                          ahead=o.read_ahead, dpi=o.dpi)
    admitted: dict[int, object] = {}  # request index (Result.rid) -> its page, until its markdown is written

    def requests():
        rid = 0
        for item in stream:
            if item.error is not None:
                emit("failed", key=item.ref.name, path=item.ref.path, error=item.error)
                continue
            admitted[rid] = item.ref
            rid += 1
            yield item.enc

    for res in engine.generate(requests(), max_new_tokens=o.max_new_tokens, max_batch=o.max_batch):
        ref = admitted.pop(res.rid)
        write_text_atomic(job.out / markdown_name(ref.name), res.text + "\n")
        emit("done", key=ref.name, tokens=len(res.tokens), seconds=round(res.seconds, 3),
             gave=res.gave)  # speculative decoding's tally: verify steps by tokens given (empty without)


def _engine_worker(device: str, feed, emit, job: _Job) -> None:
    """One engine process of `--gpus`: pages from the pool's shards until there are none left."""
    engine = build_engine(job.model_dir, device, job.options)
    emit("ready")
    parse_refs(engine, device, (ref for _, ref in feed), job, emit)


def parse(checkpoint, pages, out, options: ParseOptions = ParseOptions(), console=None, **fields) -> dict:
    """Parse every page of `pages` (a folder, a file, any fsspec URL) into `out`; returns the
    summary written to out/summary.json. Named fields override options."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .data.listing import list_pages
    from .model.load import resolve_model_dir
    from .runtime.measure import acceptance_summary, merge_gave

    o = replace(options, **fields)
    if o.gpus is not None and o.ray is None and o.device.split(":")[0] == "cuda" and o.device != "cuda":
        raise OcriaError(f"--gpus picks the GPUs itself; give --device cuda, not {o.device}")
    # The checkpoint first, before any page is read: a folder of pages given as the checkpoint
    # (`ocriaquant parse my_pages/`) is refused at once, weights missing too.
    model_dir = resolve_model_dir(checkpoint)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OcriaError(f"{out}: exists and is not a directory")
    listing = list_pages(pages)  # names, no pixels; no page at all is an error there
    _check_unique(listing.refs, pages)
    out.mkdir(parents=True, exist_ok=True)
    todo = [r for r in listing.refs if o.redo or not (out / markdown_name(r.name)).exists()]
    job = _Job(model_dir, out, o)
    tally = {"tokens": 0, "failed": [], "parsed": 0, "by_worker": {}, "gave": []}
    t0 = time.time()
    with Progress(TextColumn("parsing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, redirect_stdout=False, redirect_stderr=False) as bar:
        task = bar.add_task("pages", total=len(todo))

        def on_event(worker, kind, key, data) -> None:
            if kind == "done":
                tally["tokens"] += data["tokens"]
                tally["gave"] = merge_gave([tally["gave"], data.get("gave", [])])  # speculative decoding (#55)
                tally["parsed"] += 1
                tally["by_worker"][worker] = tally["by_worker"].get(worker, 0) + 1
            elif kind == "failed":
                tally["failed"].append({"path": data["path"], "page": key, "error": data["error"]})
            if key is not None:
                bar.advance(task)

        if o.ray is not None:
            extra = _run_ray(todo, job, on_event)
        elif o.gpus is not None:
            extra = _run_pool(todo, job, on_event)
            for w in extra["workers"]:
                w["pages"] = tally["by_worker"].get(w["worker"], 0)
        else:
            engine = build_engine(model_dir, o.device, o)
            extra = {"load_seconds": round(time.time() - t0, 2)}
            t0 = time.time()
            parse_refs(engine, o.device, iter(todo), job, lambda kind, key=None, **data: on_event(None, kind, key, data))
    secs = time.time() - t0
    failed = [{"path": path, "error": err} for path, err in listing.bad] + tally["failed"]
    if failed:  # the CLI shows it; the summary keeps every one
        warnings.warn(f"skipped {len(failed)} unreadable page(s): " + ", ".join(f["path"] for f in failed[:5])
                      + (" …" if len(failed) > 5 else ""), stacklevel=2)
    summary = {"checkpoint": str(checkpoint) if checkpoint else "bundled model", "pages": len(listing.refs),
               "parsed": tally["parsed"], "already_done": len(listing.refs) - len(todo), "failed": failed,
               "tokens": tally["tokens"], "seconds": round(secs, 2),
               "tokens_per_s": round(tally["tokens"] / secs, 1) if secs > 0 else None,
               "device": o.device, "backend": o.backend, **extra}
    if o.spec:  # speculative decoding (#55): tokens per verify step, 1 to spec+1; the distribution is what
        summary.update(spec=o.spec, **acceptance_summary(tally["gave"]))  # bench --acceptance reads
    write_json_atomic(out / "summary.json", summary)
    return summary


def _check_unique(refs, pages) -> None:
    seen: dict[str, str] = {}
    for r in refs:
        md = markdown_name(r.name)
        if md in seen:
            raise OcriaError(f"{pages}: {seen[md]} and {r.name} would both be written as {md}; rename one of them")
        seen[md] = r.name


def _run_pool(todo, job: _Job, on_event) -> dict:
    """`--gpus`: one engine process per device; the summary says which worker parsed each page,
    and, for a worker that died, the pages it held (a rerun parses them)."""
    from .scale.devices import worker_devices
    from .scale.pool import run_pool, shards

    devices = worker_devices(job.options.gpus, job.options.device)
    report = run_pool(_engine_worker, devices, shards([(r.name, r) for r in todo], SHARD_PAGES), job, on_event)
    done = report.workers
    workers, lost = [], []
    for w in done:
        # A page whose markdown is on disk was finished, even if its worker died before saying so.
        gone = [k for k in w.lost if not (job.out / markdown_name(k)).exists()]
        lost += [{"page": k, "worker": w.worker, "exit_code": w.exit_code} for k in gone]
        workers.append({"worker": w.worker, "device": w.device, "exit_code": w.exit_code, "lost": gone,
                        **({"error": w.error.strip().splitlines()[-1]} if w.error else {})})
    if todo and len(report.not_started) == len(todo) and all(w.exit_code != 0 for w in done):
        first = next((w.error for w in done if w.error), None)
        raise OcriaError("every engine worker failed before parsing a page" + (f":\n{first}" if first else
                         f" (exit codes {', '.join(str(w.exit_code) for w in done)})"))
    return {"workers": workers, "lost": lost, "not_started": len(report.not_started)}


def _run_ray(todo, job: _Job, on_event) -> dict:
    """`--ray`: pages as a Ray dataset, read and encoded by Ray tasks, parsed by one engine actor
    per GPU; the markdown is written here, as results stream in."""
    from .scale.ray_data import parse_on_ray

    for row in parse_on_ray(todo, job, _RayEngine):
        if row["error"]:
            on_event(None, "failed", row["name"], {"path": row["path"], "error": row["error"]})
            continue
        write_text_atomic(job.out / markdown_name(row["name"]), row["text"] + "\n")
        on_event(None, "done", row["name"], {"tokens": int(row["tokens"])})
    return {"ray": job.options.ray}


class _RayEngine:
    """A Ray Data actor: one engine, on the GPU Ray gave it (or the CPU); a batch of encoded pages
    in, their markdown out. Failed reads pass through."""

    def __init__(self, job: _Job, device: str):
        from .data.stream import unpack

        self.engine, self.o, self.unpack = build_engine(job.model_dir, device, job.options), job.options, unpack

    def __call__(self, batch: dict) -> dict:
        import pickle

        rows = list(range(len(batch["name"])))
        ok = [i for i in rows if not batch["error"][i]]
        text, tokens = {}, {}
        reqs = (self.unpack(pickle.loads(batch["enc"][i])) for i in ok)
        for res in self.engine.generate(reqs, max_new_tokens=self.o.max_new_tokens, max_batch=self.o.max_batch):
            text[ok[res.rid]], tokens[ok[res.rid]] = res.text, len(res.tokens)
        return {"name": list(batch["name"]), "path": list(batch["path"]), "error": list(batch["error"]),
                "text": [text.get(i, "") for i in rows], "tokens": [tokens.get(i, 0) for i in rows]}
