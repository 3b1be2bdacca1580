"""Metrics (NED, CER, agreement) and bootstrap confidence intervals."""

from .metrics import Interval, bootstrap_mean, cer, exact_match, ned, paired_bootstrap

__all__ = ["Interval", "bootstrap_mean", "cer", "exact_match", "ned", "paired_bootstrap"]
