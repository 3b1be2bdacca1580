"""The Qwen3.5 decoder's layers, written for serving, one file per concern: linear formats
(linear.py), the gated delta net (gdn.py), gated attention (attention.py), the MLP (mlp.py), norms
(norm.py), the per-step metadata they share (step.py), and the vision tower's attention on the
triton backend (vision.py; the rest of the tower is transformers').

Each layer is built knowing its backend: `kernels` (config.Kernels) on its Linears for the triton
backend, None for torch. The torch path runs the ops transformers runs, in the same dtype, so
greedy tokens match transformers' (tests); the kernel path runs decode steps through
runtime/kernels/, imported only when it runs (the torch backend needs no Triton). Prefill runs
as chunks of requests (step.Chunk): torch ops on the torch backend; on the triton backend cuBLAS
GEMMs (FP8 W8A8 through _scaled_mm) with the elementwise work between them in kernels."""

from .attention import Attention
from .gdn import GatedDeltaNet
from .linear import FusedLinear, QuantLinear
from .mlp import MLP
from .norm import RMSNorm, gated_rmsnorm
from .step import Chunk, Step

__all__ = ["MLP", "Attention", "Chunk", "FusedLinear", "GatedDeltaNet", "QuantLinear", "RMSNorm", "Step", "gated_rmsnorm"]
