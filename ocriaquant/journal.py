"""What search keeps of each candidate it decodes, so a killed search loses at most the candidate it was on
and a rerun that changes only the choice (tolerance, objective's ranking) decodes nothing again.

One JSON file a candidate under the search's output folder (`candidates/`), written atomically as soon as its
held-out outputs exist and again once it is timed. An entry is used only under the same *context*: the model
and calibration (the calibration's fingerprint), the held-out pages (names and contents) and their token
limits, the runtime that decoded them (device, backend, dtype, slots, graphs) and the code of this package
(a hash of its sources: a change to the numerics must not meet outputs of the old ones). Its timing is used
only under the same timing settings too; otherwise the outputs are kept and the candidate is timed again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .files import write_json_atomic

JOURNAL_VERSION = 1


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:32]


def code_hash() -> str:
    """The package's Python sources, names and contents."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:32]


class DecodeJournal:
    def __init__(self, folder: Path, context: dict, timing: dict):
        self.folder = Path(folder)
        self.context = _sha({"version": JOURNAL_VERSION, "code": code_hash(), **context})
        self.timing = _sha(timing)

    def _path(self, key) -> Path:
        return self.folder / f"{_sha([self.context, key])}.json"

    def get(self, key) -> tuple[list[str], int, dict | None] | None:
        """(outputs, tokens, timing or None where it was timed otherwise or not at all) of the candidate with
        numerics `key`, decoded under this context; None where there is no such entry (or it is unreadable:
        a file cut short is decoded again)."""
        try:
            e = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        if e.get("context") != self.context or e.get("key") != json.loads(json.dumps(key)):
            return None
        return e["preds"], e["tokens"], e["measured"] if e.get("timing") == self.timing else None

    def put(self, key, preds: list[str], tokens: int, measured: dict | None = None) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self._path(key), {"context": self.context, "key": key, "preds": preds, "tokens": tokens,
                                            "measured": measured, "timing": self.timing if measured else None})
