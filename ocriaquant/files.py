"""Writing files so that a crash never leaves half of one: write a sibling temporary file,
then rename it over the target (atomic on POSIX file systems)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # the pid: two runs never share a temp file
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=1))
