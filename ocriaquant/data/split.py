"""Deterministic calibration / held-out split by a hash of each page's name.

A page's side depends on its own name alone, so adding pages to a folder never moves the
pages already there from one side to the other.
"""

from __future__ import annotations

import hashlib
from typing import Sequence, TypeVar

from .page import Page

T = TypeVar("T", bound=Page)
SPLITS = ("calibration", "heldout")


def heldout_score(name: str, salt: str = "ocriaquant") -> float:
    """A uniform number in [0, 1) fixed by the name."""
    digest = hashlib.sha256(f"{salt}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_heldout(name: str, heldout_fraction: float = 0.5, salt: str = "ocriaquant") -> bool:
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    return heldout_score(name, salt) < heldout_fraction


def split_pages(pages: Sequence[T], heldout_fraction: float = 0.5,
                salt: str = "ocriaquant") -> tuple[list[T], list[T]]:
    """(calibration, heldout), each in the input order."""
    calib, held = [], []
    for p in pages:
        (held if is_heldout(p.name, heldout_fraction, salt) else calib).append(p)
    return calib, held


def select_split(pages: Sequence[T], split: str, heldout_fraction: float = 0.5) -> list[T]:
    """`calibration`, `heldout` or `all`."""
    if split == "all":
        return list(pages)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose calibration, heldout or all")
    calib, held = split_pages(pages, heldout_fraction)
    return held if split == "heldout" else calib
