"""Writing files so that a crash never leaves half of one: write a sibling temporary file,
then rename it over the target (atomic on POSIX file systems)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def temp_sibling(path: Path, tag: str = "tmp") -> Path:
    """A hidden name beside `path` for work in progress; the pid keeps two runs apart."""
    path = Path(path)
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}")


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    tmp = temp_sibling(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=1))


def plain_mode(path: Path) -> None:
    """Give a file the mode open() would (0o666 less the umask). safetensors 0.8 writes its files
    0o600, so a checkpoint exported by one user could not be read by a server running as another."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_safetensors_atomic(path: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    tmp = temp_sibling(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    plain_mode(tmp)
    os.replace(tmp, path)


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished directory `tmp` to `out`; an existing `out` is moved aside first and
    deleted only once the new one is in place. Owner-only files in it (what safetensors writes)
    get open()'s mode first."""
    tmp, out = Path(tmp), Path(out)
    for f in tmp.rglob("*"):
        if f.is_file() and not f.stat().st_mode & 0o044:
            plain_mode(f)
    old = temp_sibling(out, "old")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
