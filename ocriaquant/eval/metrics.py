"""Text metrics for parsed pages and confidence intervals for comparing systems.

NED  normalized edit distance = Levenshtein(pred, ref) / max(len(pred), len(ref)), in [0, 1];
     0 for two empty strings. Symmetric, so it also measures agreement between two systems.
CER  character error rate = Levenshtein(pred, ref) / len(ref); can exceed 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from rapidfuzz.distance import Levenshtein


def ned(pred: str, ref: str) -> float:
    if not pred and not ref:
        return 0.0
    return Levenshtein.distance(pred, ref) / max(len(pred), len(ref))


def cer(pred: str, ref: str) -> float:
    if not ref:
        return 0.0 if not pred else 1.0
    return Levenshtein.distance(pred, ref) / len(ref)


def exact_match(pred: str, ref: str) -> float:
    return float(pred.strip() == ref.strip())


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    confidence: float

    def __str__(self) -> str:
        return f"{self.estimate:.4f} [{self.low:.4f}, {self.high:.4f}]"


def _check(scores: Sequence[float], name: str) -> np.ndarray:
    arr = np.asarray(scores, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name}: need a non-empty 1-D sequence of per-page scores")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: contains NaN or Inf")
    return arr


def bootstrap_mean(scores: Sequence[float], n_resamples: int = 10_000, confidence: float = 0.95,
                   seed: int = 0) -> Interval:
    """Mean of per-page scores with a percentile bootstrap interval."""
    x = _check(scores, "scores")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_resamples, x.size))
    means = x[idx].mean(axis=1)
    a = (1 - confidence) / 2
    return Interval(float(x.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a)), confidence)


def paired_bootstrap(base: Sequence[float], other: Sequence[float], n_resamples: int = 10_000,
                     confidence: float = 0.95, seed: int = 0) -> Interval:
    """Mean of (other - base) over the same pages, resampling pages jointly.

    Pairing matters: page difficulty varies far more than the effect of quantization, so
    resampling the two systems independently would give intervals many times too wide.
    """
    a, b = _check(base, "base"), _check(other, "other")
    if a.size != b.size:
        raise ValueError(f"paired scores need the same pages: {a.size} vs {b.size}")
    return bootstrap_mean(b - a, n_resamples, confidence, seed)
