"""The Qwen3.5 decoder's layers, written for serving, one file per concern: linear formats
(linear.py), the gated delta net (gdn.py), gated attention (attention.py), the MLP (mlp.py), norms
(norm.py), and the per-step metadata they share (step.py).

Each layer is built knowing its backend: `kernels` (config.Kernels) on its Linears for the triton
backend, None for torch. The torch path runs the ops transformers runs, in the same dtype, so
greedy tokens match transformers' (tests); the kernel path runs decode steps through
runtime/kernels/, imported only when it runs (the torch backend needs no Triton). Prefill is
torch on both (FP8 prefill GEMMs excepted, linear.py), run as chunks of requests (step.Chunk)."""

from .attention import Attention
from .gdn import GatedDeltaNet
from .linear import FusedLinear, QuantLinear
from .mlp import MLP
from .norm import RMSNorm, gated_rmsnorm
from .step import Chunk, Step

__all__ = ["MLP", "Attention", "Chunk", "FusedLinear", "GatedDeltaNet", "QuantLinear", "RMSNorm", "Step", "gated_rmsnorm"]
