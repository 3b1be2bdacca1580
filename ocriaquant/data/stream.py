"""Pages read, rendered and preprocessed ahead of their consumer by worker processes.

`stream_pages(refs, encoder)` yields one `Encoded` per PageRef, in the order of `refs`, while
worker processes open, render and encode the pages after it. At most `ahead + workers` pages are
handed out and not yet yielded, so memory stays flat whatever the number of pages, and the
consumer (the engine, on the GPU) never waits for a page that a worker could have read while it
decoded. `refs` is pulled lazily: it may be a generator fed from elsewhere (a shard queue).

A page that cannot be read or encoded comes out with `error` set (its path and the fix) and the
stream goes on; so does a page whose worker process died (it is replaced).

`encoder` is a picklable factory, called once in each worker: `encoder()` returns a function
Page -> dict of tensors or arrays (model/processor.py's `PageEncoder`). Workers are started with
`spawn` (CUDA-safe, and the same on every platform), so the factory must be importable.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Callable, Iterable, Iterator

from ..errors import OcriaError
from .listing import PageRef, PageReader

# How long the dispatcher waits on its workers before it looks again for room to hand out pages.
_POLL_S = 0.5


@dataclass
class Encoded:
    ref: PageRef
    enc: dict | None = None  # the encoder's output (tensors), None if the page failed
    error: str | None = None


def read_encode(reader: PageReader, encode: Callable, ref: PageRef) -> Encoded:
    try:
        return Encoded(ref, encode(reader.read(ref)))
    except OcriaError as e:
        return Encoded(ref, error=str(e))
    except Exception as e:  # noqa: BLE001 - one page's failure, whatever it is, must not stop the others
        return Encoded(ref, error=f"{ref.path}: cannot encode page {ref.name} ({type(e).__name__}: {e})")


def pack(enc: dict) -> dict:
    """Tensors cross the pipe as numpy arrays: torch's own pickling would share memory through
    file descriptors that die with the worker. BF16, which numpy lacks, goes as its int16 bits."""
    def one(v):
        if not type(v).__module__.startswith("torch"):
            return "raw", v
        import torch

        if v.dtype == torch.bfloat16:
            return "torch_bf16", v.view(torch.int16).numpy()
        return "torch", v.numpy()

    return {k: one(v) for k, v in enc.items()}


def unpack(enc: dict) -> dict:
    out = {}
    for k, (kind, v) in enc.items():
        if kind in ("torch", "torch_bf16"):
            import torch

            v = torch.from_numpy(v)
            if kind == "torch_bf16":
                v = v.view(torch.bfloat16)
        out[k] = v
    return out


def _worker(conn, encoder, dpi: int) -> None:
    """A reader process: (index, ref) in, (index, Encoded) out, on its own pipe, until None."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import sys

        if "torch" in sys.modules:  # one thread each: the workers, not their threads, are the parallelism
            sys.modules["torch"].set_num_threads(1)
        encode, reader = encoder(), PageReader(dpi)
    except BaseException:  # noqa: BLE001 - the consumer raises it, with the worker's traceback
        conn.send((None, traceback.format_exc()))
        return
    try:
        conn.send((None, None))  # started: from now on a death is a page's doing
        while (task := conn.recv()) is not None:
            i, ref = task
            item = read_encode(reader, encode, ref)
            if item.enc is not None:
                item.enc = pack(item.enc)
            conn.send((i, item))  # synchronous: once sent, a crash on the next page cannot lose it
    except (EOFError, BrokenPipeError):
        pass  # the consumer is gone (killed): nothing left to read for
    finally:
        reader.close()


def stream_pages(refs: Iterable[PageRef], encoder: Callable[[], Callable], *, workers: int = 2, ahead: int = 4,
                 dpi: int = 150) -> Iterator[Encoded]:
    """Encoded pages in the order of `refs`; `workers` processes read and encode up to `ahead`
    pages past the one the consumer waits for (0 workers: read in this process, one at a time)."""
    if workers < 0 or ahead < 0:
        raise OcriaError(f"page readers: workers and ahead must be >= 0, got {workers}, {ahead}")
    if workers == 0:
        return _inline(refs, encoder, dpi)
    return _ProcessStream(refs, encoder, workers, ahead, dpi).run()


def _inline(refs, encoder, dpi) -> Iterator[Encoded]:
    encode, reader = encoder(), PageReader(dpi)
    try:
        for ref in refs:
            yield read_encode(reader, encode, ref)
    finally:
        reader.close()


class _ProcessStream:
    """A dispatcher thread hands each idle worker one page on its own pipe and collects what
    comes back, also while the consumer is busy between two pages. One page per worker: a worker
    that dies is known to have held exactly that page, which fails; a new worker takes its place."""

    def __init__(self, refs, encoder, workers: int, ahead: int, dpi: int):
        self.refs, self.encoder, self.dpi = iter(refs), encoder, dpi
        self.window = ahead + workers  # pages handed out and not yet taken by the consumer, at most
        self.ctx = mp.get_context("spawn")
        self.procs: list = [None] * workers
        self.conns: list = [None] * workers
        self.held: list = [None] * workers  # worker -> (index, ref) it is reading, or None
        self.started: list[bool] = [False] * workers  # its encoder is built
        self.cond = threading.Condition()
        self.ready: dict[int, Encoded] = {}
        self.issued = self.taken = 0
        self.exhausted = self.stopping = False
        self.error: BaseException | None = None

    def _start(self, w: int) -> None:
        mine, theirs = self.ctx.Pipe()
        self.procs[w] = self.ctx.Process(target=_worker, args=(theirs, self.encoder, self.dpi), daemon=True,
                                         name=f"ocriaquant-reader-{w}")
        self.procs[w].start()
        theirs.close()
        self.conns[w], self.held[w], self.started[w] = mine, None, False

    def run(self) -> Iterator[Encoded]:
        for w in range(len(self.procs)):
            self._start(w)
        thread = threading.Thread(target=self._dispatch, name="ocriaquant-page-dispatch", daemon=True)
        thread.start()
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.error or self.taken in self.ready
                                       or (self.exhausted and self.taken == self.issued))
                    if self.error:
                        raise self.error
                    if self.taken not in self.ready:
                        return
                    item = self.ready.pop(self.taken)
                yield item
                with self.cond:
                    self.taken += 1
                    self.cond.notify_all()
        finally:
            with self.cond:
                self.stopping = True
            thread.join()
            self._stop()

    def _dispatch(self) -> None:
        try:
            while not self.stopping:
                self._hand_out()
                conns = [c for c, h in zip(self.conns, self.held) if h is not None]
                sentinels = [p.sentinel for p, h in zip(self.procs, self.held) if h is not None]
                for ready in wait(conns + sentinels, timeout=_POLL_S) if conns else self._idle():
                    if self._receive(ready):
                        break  # a worker was replaced: the rest of this list may name its reused fds
        except BaseException as e:  # noqa: BLE001 - raised in the consumer
            with self.cond:
                self.error = e if isinstance(e, OcriaError) else OcriaError(f"page stream: {type(e).__name__}: {e}")
                self.cond.notify_all()

    def _idle(self) -> list:
        with self.cond:  # nothing in flight: wait for the consumer to make room
            self.cond.wait(timeout=_POLL_S)
        return []

    def _hand_out(self) -> None:
        for w in range(len(self.procs)):
            if self.held[w] is None and not self.procs[w].is_alive():  # died between two pages
                self.conns[w].close()
                self._start(w)
            with self.cond:
                if self.exhausted or self.held[w] is not None or self.issued - self.taken >= self.window:
                    continue
            ref = next(self.refs, None)  # outside the lock: a shard feed may block on its coordinator
            with self.cond:
                if ref is None:
                    self.exhausted = True
                    self.cond.notify_all()
                    return
                self.held[w] = (self.issued, ref)
                self.issued += 1
            self.conns[w].send(self.held[w])

    def _receive(self, ready) -> bool:
        """Read what `ready` (a worker's pipe or its sentinel) says; True if the worker died and
        was replaced."""
        w = next((k for k, c in enumerate(self.conns) if c is ready), None)
        if w is None:
            w = next((k for k, p in enumerate(self.procs) if p.sentinel == ready), None)
            if w is None:  # a replaced worker's: handled already
                return False
        # Its messages first (a page that came through before it died counts), then its death.
        eof = False
        while self.conns[w].poll():
            try:
                i, item = self.conns[w].recv()
            except (EOFError, OSError):
                eof = True
                break
            if i is None and item is None:
                self.started[w] = True
            elif i is None:
                raise OcriaError(f"a page reader process could not start its encoder:\n{item}")
            else:
                if item.enc is not None:
                    item.enc = unpack(item.enc)
                self._done(w, i, item)
            if ready is self.conns[w]:
                return False
        if ready is self.conns[w] and not eof:
            return False
        self.procs[w].join(timeout=5)  # gone: reap it for the exit code
        held, code = self.held[w], self.procs[w].exitcode
        if not self.started[w]:
            raise OcriaError(f"a page reader process died while starting (exit code {code}); its encoder "
                             f"{self.encoder!r} must be importable from a fresh interpreter (spawn)")
        self.conns[w].close()
        self._start(w)
        if held is not None:
            i, ref = held
            self._done(w, i, Encoded(ref, error=f"{ref.path}: the page reader process died (exit code {code}) "
                                                f"while reading {ref.name}; check the file (the other pages are parsed)"))
        return True

    def _done(self, w: int, i: int, item: Encoded) -> None:
        with self.cond:
            self.held[w] = None
            self.ready[i] = item
            self.cond.notify_all()

    def _stop(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, ValueError):
                pass
        for p, c in zip(self.procs, self.conns):
            p.join(timeout=5)
            if p.is_alive():  # still reading a page nobody wants (the consumer left early)
                p.kill()
                p.join()
            c.close()
