"""How a runtime is built, chosen once at construction: backend, device, dtype, slots, cache
length, CUDA graphs, PDL, the GEMV tile table."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ..errors import OcriaError
from .tiles import TileTable

BACKENDS = ("torch", "triton")
MAX_SPEC = 8  # draft tokens per speculative step, at most


def pdl_from_env() -> bool:
    """OCRIAQUANT_PDL=0 turns programmatic dependent launch off, to debug kernels one after
    another; the package's only environment switch."""
    return os.environ.get("OCRIAQUANT_PDL", "1") != "0"


@dataclass(frozen=True)
class RuntimeConfig:
    """backend: "torch" (the reference path: transformers' ops, CPU or GPU) or "triton" (decode
    through runtime/kernels/; prefill torch, its FP8 GEMMs W8A8 on the tensor cores). max_slots: sequences held at once;
    max_len: cache length per slot. cuda_graphs: the triton backend on a GPU replays a graph per
    batch bucket. pdl: kernels launch with programmatic dependent launch where the GPU has it
    (Hopper on). tiles: the GEMV tiles; None reads ocriaquant/recipes/tiles/h200.json when the triton
    backend needs it. spec: draft tokens per speculative step (0: none; > 0 needs the
    checkpoint's MTP layer, #55); draft / draft_vocab: the drafter's weights — the MTP layer's
    BF16 Linears and the head drafts are scored with (models/mtp.draft_head) — in "bf16" or "fp8"
    (per-channel, made at load), and the lowest `draft_vocab` ids only (0: all)."""
    backend: str = "torch"
    device: str | torch.device = "cpu"
    dtype: torch.dtype = torch.bfloat16
    max_slots: int = 8
    max_len: int = 2048
    cuda_graphs: bool = True
    pdl: bool = field(default_factory=pdl_from_env)
    tiles: TileTable | None = None
    spec: int = 0
    draft: str = "bf16"
    draft_vocab: int = 0

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise OcriaError(f"unknown runtime backend {self.backend!r}; one of {', '.join(BACKENDS)}")
        if self.max_slots < 1 or self.max_len < 2:
            raise OcriaError(f"the runtime needs at least 1 slot and a cache of 2 tokens; got max_slots "
                             f"{self.max_slots}, max_len {self.max_len}")
        if not 0 <= self.spec <= MAX_SPEC or self.draft_vocab < 0 or self.draft not in ("bf16", "fp8"):
            raise OcriaError(f"speculative decoding takes 0 to {MAX_SPEC} draft tokens, drafter weights in bf16 or fp8 "
                             f"and a draft vocabulary >= 0; got spec {self.spec}, draft {self.draft!r}, "
                             f"draft_vocab {self.draft_vocab}")
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def kernels(self) -> bool:
        return self.backend == "triton"

    def kernel_settings(self) -> "Kernels | None":
        """What the triton backend's layers launch with (None: the torch backend). PDL only
        where the GPU has it: CUDA, compute capability 9 or more."""
        if not self.kernels:
            return None
        dev = self.device
        pdl = self.pdl and dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9
        return Kernels(pdl=pdl, tiles=self.tiles or TileTable.default())


@dataclass
class Kernels:
    """Handed to every layer of the triton backend (None there: the torch backend), one object
    shared by all of them."""
    pdl: bool
    tiles: TileTable
