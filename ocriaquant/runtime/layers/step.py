"""The per-step batch metadata every layer reads: Step for a decode step, Chunk for a prefill pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Step:
    """Built once per decode step (ModelRunner) and shared by every layer."""
    slots: torch.Tensor          # int64 [B]
    lengths: torch.Tensor        # int64 [B]: tokens already cached = position of the new token
    cos: torch.Tensor            # [B, rot] M-RoPE
    sin: torch.Tensor
    slots32: torch.Tensor        # int32 copies, what the kernels take
    lengths32: torch.Tensor
    span: int = 0                # torch backend only: max(lengths) + 1 (a host sync)
    in_order: bool = False       # torch backend only: row b holds slot b (in_order(slots))


def in_order(slots: torch.Tensor) -> bool:
    """Whether rows hold slots 0..B-1 in order, as a batch admitted at once does: the torch path then
    reads and updates the caches' own prefix in place, with no gather or scatter (on a CPU those were
    a third of a decode step). A host sync, which the torch path takes anyway (span)."""
    return bool((slots == torch.arange(slots.shape[0], device=slots.device)).all())


def slot_rows(t: torch.Tensor, step: Step) -> torch.Tensor:
    """A per-slot state's rows for the step's rows: its own prefix (a view, updated in place) when the
    step is in order, else a copy gathered with index_select (the caller writes it back)."""
    return t[: step.slots.shape[0]] if step.in_order else t.index_select(0, step.slots)


@dataclass(frozen=True)
class Chunk:
    """One request's share of a prefill pass: n prompt tokens from position `start`, into `slot`.
    A pass runs several chunks' rows concatenated (ModelRunner.prefill_chunks)."""
    slot: int
    start: int
    n: int
