"""Quiet by default: what the libraries we call print goes to a log file, not the terminal.

transformers and torch speak through `logging` and `warnings`, llmcompressor and
compressed-tensors through loguru, and all of them draw tqdm bars on stderr; together they bury
our output and break our progress bars. While a verb runs inside `quiet(path)`:

- loguru's sinks, every plain `logging.StreamHandler` and the root logger, `warnings`, and
  anything written to sys.stdout / sys.stderr (tqdm, print) go to `path`, opened only when the
  first line arrives, one header per run;
- the consoles given keep the terminal, so our own lines and progress bars stay whole;
- a warning raised by ocriaquant's own code (a skipped page) still reaches the terminal;
- a library warning we cannot fix is explained once, in our words (`EXPLAINED`), and the run
  ends with one line naming the log.

`--verbose` skips all of this: the libraries print as they always do.
"""

from __future__ import annotations

import io
import logging
import sys
import threading
import time
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

LOG_NAME = "ocriaquant.log"

# Library warnings ocriaquant cannot fix: (text the warning holds, what it means for the user).
EXPLAINED: tuple[tuple[str, str], ...] = (
    ("falling back to its reference PyTorch implementation",
     "Qwen3.5's linear attention runs on transformers' PyTorch path (fla-core is not installed): right on "
     "a CPU; on a GPU, `pip install fla-core` makes it faster."),
    ("save a model with offloaded modules",
     "transformers' '50GB' warning: llmcompressor saves through CPU offloading, so saving holds one shard "
     "(up to 50 GB) in CPU memory."),
    ("key in original config",
     "llmcompressor's 'Failed to find dtype' warning: the checkpoint keeps transformers' config.json, as "
     "expected with Qwen3.5's configs."),
)


class LibraryLog:
    """The log file, opened (with its parent folder) at the first text written, and the
    explanations already given. Thread-safe: tqdm and loguru may write from other threads."""

    def __init__(self, path: str | Path, title: str = "", note: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.title = title
        self.note = note
        self.chars = 0
        self.explained: list[str] = []
        self._file = None
        self._closed = False
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        if not text:
            return
        with self._lock:
            if self._closed:
                return
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                self._file.write(f"\n===== {stamp} ocriaquant {self.title}".rstrip() + " =====\n")
            self._file.write(text)
            self._file.flush()
            self.chars += len(text)
            new = [(pattern, why) for pattern, why in EXPLAINED if pattern in text and pattern not in self.explained]
            self.explained += [pattern for pattern, _ in new]
        for _, why in new:
            if self.note is not None:
                self.note(why)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()


class _Stream(io.TextIOBase):
    """sys.stdout or sys.stderr while quiet: text goes to the log (to `real` once it is closed)."""

    def __init__(self, log: LibraryLog, real):
        self._log, self._real = log, real

    def write(self, text: str) -> int:
        (self._real.write if self._log._closed else self._log.write)(text)
        return len(text)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:  # for code that hands the stream to a subprocess
        return self._real.fileno()

    @property
    def encoding(self) -> str:
        return "utf-8"


class _ToLog(logging.Handler):
    def __init__(self, log: LibraryLog):
        super().__init__()
        self.log = log
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def _from_ocriaquant() -> bool:
    """Whether the warning being shown was raised by ocriaquant's own code: the first frame
    outside the `warnings` module belongs to an ocriaquant module that calls `warn`. (A torch
    warning raised from C++ under one of our frames does not: that function calls no `warn`.)"""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in ("warnings", "_py_warnings", __name__):
        frame = frame.f_back
    if frame is None:
        return False
    module = frame.f_globals.get("__name__", "")
    return module.split(".")[0] == "ocriaquant" and "warn" in frame.f_code.co_names


def _stream_handlers() -> Iterator[logging.StreamHandler]:
    """Every plain StreamHandler on a logger (transformers' and the like); file handlers and
    subclasses (pytest's capture) are left alone."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for lg in loggers:
        for h in lg.handlers:
            if type(h) is logging.StreamHandler:
                yield h


def _set_stream(handler: logging.StreamHandler, stream) -> None:
    try:
        handler.setStream(stream)
    except (ValueError, OSError):  # its old stream is closed already (a test runner's, say): nothing to flush
        handler.stream = stream


@contextmanager
def quiet(path: str | Path, *, title: str = "", verbose: bool = False, consoles=(),
          note: Callable[[str], None] | None = None, warn: Callable[[str], None] | None = None,
          done: Callable[[LibraryLog], None] | None = None):
    """Route the libraries' output to the log file `path` while the block runs (nothing at all
    with `verbose`). `consoles` (rich Consoles that follow sys.stdout / sys.stderr) keep the
    terminal during the block. `note(text)` prints an explanation, `warn(text)` one of our own
    warnings; `done(log)` runs at the end when something was logged. Yields the LibraryLog
    (None with `verbose`)."""
    if verbose:
        yield None
        return
    log = LibraryLog(path, title, note)
    real_out, real_err = sys.stdout, sys.stderr
    out, err = _Stream(log, real_out), _Stream(log, real_err)
    with ExitStack() as undo:  # each step's undo, run in reverse order, also when a step fails
        undo.callback(_finish, log, done)
        for c in consoles:
            c.file = real_err if c.stderr else real_out
            undo.callback(setattr, c, "file", None)  # follows sys.stdout / sys.stderr again

        root_handler = _ToLog(log)
        logging.getLogger().addHandler(root_handler)
        undo.callback(logging.getLogger().removeHandler, root_handler)
        redirected = [(h, h.stream) for h in _stream_handlers()]
        undo.callback(_restore_handlers, redirected, {id(out): real_out, id(err): real_err})
        for h, _ in redirected:
            _set_stream(h, out if h.stream is real_out or h.stream is sys.__stdout__ else err)

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if _from_ocriaquant():
                if warn is not None:
                    warn(str(message))
            else:
                log.write(warnings.formatwarning(message, category, filename, lineno, line))

        undo.callback(setattr, warnings, "showwarning", warnings.showwarning)
        warnings.showwarning = showwarning

        try:
            from loguru import logger as loguru
        except ImportError:  # llmcompressor brings loguru; without it there is nothing to route
            loguru = None
        if loguru is not None:
            undo.callback(_restore_loguru, loguru)
            loguru.remove()
            loguru.add(lambda m: log.write(str(m)), level="INFO",
                       format="{time:HH:mm:ss} | {name} | {level} - {message}\n")

        undo.callback(setattr, sys, "stderr", real_err)
        undo.callback(setattr, sys, "stdout", real_out)
        sys.stdout, sys.stderr = out, err
        yield log


def _finish(log: LibraryLog, done: Callable[[LibraryLog], None] | None) -> None:
    log.close()
    if log.chars and done is not None:
        done(log)


def _restore_handlers(redirected: list, ours: dict) -> None:
    """The redirected handlers get their streams back; those created during the block (a library
    imported then) get the stream sys.stdout / sys.stderr was."""
    for h, stream in redirected:
        _set_stream(h, stream)
    for h in _stream_handlers():
        if id(h.stream) in ours:
            _set_stream(h, ours[id(h.stream)])


def _restore_loguru(loguru) -> None:
    """loguru as it was configured before the block: llmcompressor's console logger where it is
    imported, loguru's default stderr sink otherwise."""
    loguru.remove()
    llmc = sys.modules.get("llmcompressor.logger")
    if llmc is not None:
        llmc.configure_logger(llmc.LOGGER_CONFIG)
    else:
        loguru.add(sys.stderr)
