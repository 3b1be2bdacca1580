"""One engine process per device on one host, each pulling shards of work from the coordinator.

`run_pool(target, devices, shards, job, on_event)` starts one process per device (spawn: CUDA
needs it) running `target(device, feed, emit, job)`. `feed` yields (key, item) pairs; a worker
asks the coordinator for the next shard only when it has used up the last one, so fast engines
take more and every item is handed out exactly once. `emit(kind, key=…, **data)` reports to the
coordinator (`on_event(worker, kind, key, data)`); an event with a key means that item is
finished, done or failed. A worker that dies loses only the items it held and had not reported:
`PoolReport` names them, and the other workers carry on with the rest of the shards.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Callable, Iterator

_POLL_S = 0.5


def shards(items: list, size: int) -> list[list]:
    """`items` cut into consecutive shards of `size` (the last one shorter): each item in exactly one."""
    if size < 1:
        raise ValueError(f"shard size must be >= 1, got {size}")
    return [items[i:i + size] for i in range(0, len(items), size)]


@dataclass
class WorkerExit:
    worker: int
    device: str
    exit_code: int | None
    error: str | None = None  # the tail of its traceback, if the target raised
    lost: list[str] = field(default_factory=list)  # keys it held and never reported


@dataclass
class PoolReport:
    workers: list[WorkerExit]
    not_started: list[str]  # keys never handed out (every worker was gone)
    seconds: float  # from the start of work (after every worker was ready, with wait_ready) to the end
    started_at: float  # time.perf_counter() at that start


class _Channel:
    """The worker's end of its pipe. Sends are locked: the feed is pulled from a reader thread
    while results are reported from the engine's."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, msg) -> None:
        with self.lock:
            self.conn.send(msg)

    def emit(self, kind: str, key: str | None = None, **data) -> None:
        self.send(("event", kind, key, data))

    def feed(self) -> Iterator[tuple[str, Any]]:
        while True:
            self.send(("want",))
            shard = self.conn.recv()
            if shard is None:
                return
            yield from shard


def _worker_main(target, device: str, cuda_visible: str | None, threads: int, conn, job, log: str | None) -> None:
    if cuda_visible is not None:  # before anything touches CUDA: this worker sees its GPU only, as cuda:0
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible
    if log is not None:  # the libraries' messages go where the CLI sends its own (logs.quiet), C level included
        f = open(log, "a", buffering=1, encoding="utf-8")
        for fd in (1, 2):
            os.dup2(f.fileno(), fd)
        sys.stdout = sys.stderr = f
    chan = _Channel(conn)
    try:
        if device == "cpu":
            import torch

            torch.set_num_threads(threads)  # CPU engines share the cores instead of fighting over them
        target(device, chan.feed(), chan.emit, job)
    except BaseException:  # noqa: BLE001 - reported to the coordinator, then the worker exits
        chan.send(("error", traceback.format_exc()[-3000:]))
        raise SystemExit(1)
    chan.send(("exit",))


def run_pool(target: Callable, devices: list[tuple[str, str | None]], work: list[list[tuple[str, Any]]], job,
             on_event: Callable[[int, str, str | None, dict], None] = lambda *a: None,
             wait_ready: bool = False) -> PoolReport:
    """Run `target` in one process per (device, CUDA_VISIBLE_DEVICES) over the shards `work`.
    wait_ready: hold every shard until each live worker has emitted "ready" (benchmarks time the
    work, not the engines' start)."""
    ctx = mp.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // len(devices))
    quiet_log = getattr(getattr(sys.stderr, "_log", None), "path", None)  # logs.quiet's file, when the CLI is quiet
    todo = deque(work)
    procs, conns, held, exits, ready = [], [], [], {}, set()
    for w, (device, visible) in enumerate(devices):
        mine, theirs = ctx.Pipe()
        # Not a daemon: an engine worker starts page reader processes of its own.
        p = ctx.Process(target=_worker_main, args=(target, device, visible, threads, theirs, job,
                                                        None if quiet_log is None else str(quiet_log)),
                        name=f"ocriaquant-engine-{w}")
        p.start()
        theirs.close()
        procs.append(p)
        conns.append(mine)
        held.append({})  # key -> None: items handed to it and not yet reported
    waiting: list[int] = []  # workers asking for a shard while the pool waits for every worker to be ready
    t0 = None if wait_ready else time.perf_counter()
    errors: dict[int, str] = {}

    def give(w: int) -> None:
        shard = todo.popleft() if todo else None
        for key, _ in shard or ():
            held[w][key] = None
        conns[w].send(shard)

    def finish(w: int) -> None:
        procs[w].join(timeout=10)
        code = procs[w].exitcode
        exits[w] = WorkerExit(w, devices[w][0] if devices[w][1] is None else f"cuda (GPU {devices[w][1]})", code,
                              errors.get(w), list(held[w]) if code != 0 else [])
        conns[w].close()

    try:
        while len(exits) < len(procs):
            live = [w for w in range(len(procs)) if w not in exits]
            if t0 is None and live and all(w in ready for w in live):
                t0 = time.perf_counter()
                for w in waiting:
                    give(w)
                waiting.clear()
            objs = [conns[w] for w in live] + [procs[w].sentinel for w in live]
            for obj in wait(objs, timeout=_POLL_S):
                w = next((k for k in live if conns[k] is obj or procs[k].sentinel == obj))
                if w in exits:
                    continue
                if obj is conns[w]:
                    try:
                        msg = conns[w].recv()
                    except (EOFError, OSError):
                        finish(w)  # died: its pipe closed
                        continue
                    if msg[0] == "want":
                        if t0 is None:
                            waiting.append(w)
                        else:
                            give(w)
                    elif msg[0] == "event":
                        _, kind, key, data = msg
                        if kind == "ready":
                            ready.add(w)
                        if key is not None:
                            held[w].pop(key, None)
                        on_event(w, kind, key, data)
                    elif msg[0] == "error":
                        errors[w] = msg[1]
                    elif msg[0] == "exit":
                        finish(w)
                elif not conns[w].poll():  # its last messages are read before it counts as gone
                    finish(w)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    t0 = t0 if t0 is not None else time.perf_counter()
    return PoolReport([exits[w] for w in range(len(procs))], [k for shard in todo for k, _ in shard],
                      time.perf_counter() - t0, t0)
