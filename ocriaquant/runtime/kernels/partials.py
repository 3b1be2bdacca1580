"""The one value type the decode layers and the kernels share. No Triton here: the torch
backend, which runs where Triton is not installed, imports it too."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Partials(NamedTuple):
    """A batch-1 split-K GEMV's output left unreduced: fp32 parts [S, M, N] whose sum over S, in
    order, rounded to bf16, is the GEMV's output (what store_or_reduce's last CTA computes). The
    decode step hands it to add_rmsnorm, which adds the parts as it reads the residual: the GEMV's
    CTAs store and exit, with no ticket round trip and no last-CTA reduction at its tail. A view
    of the GEMV's workspace: valid until the next GEMV of that shape runs."""
    parts: torch.Tensor
