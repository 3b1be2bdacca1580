"""The SwiGLU MLP: down(silu(gate(x)) · up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.partials import Partials
from .linear import FusedLinear, QuantLinear


class MLP(nn.Module):
    """With kernels (the triton backend) gate and up run as one weight stream when they share a
    format (gate_up), and silu · mul happens in a kernel: gate_up's epilogue at batch 1 where the
    formats allow, else silu_mul_quant, which also writes down_proj's input form."""

    def __init__(self, gate: QuantLinear, up: QuantLinear, down: QuantLinear):
        super().__init__()
        self.kernels = down.kernels
        self.down_proj = down
        self.gate_up = FusedLinear.of([gate, up]) if self.kernels else None
        if self.gate_up is None:  # fused, the parts' weights live in gate_up only
            self.gate_proj, self.up_proj = gate, up

    def fused_silu(self) -> bool:
        """Whether batch 1 runs gate_up, silu·mul and the NVFP4 activation pairs in one launch
        (gemv_nvfp4_silu): W4A16 gate_up fused and a W4A16 down_proj."""
        return self.gate_up is not None and self.gate_up.linear.kind == "nvfp4" and self.down_proj.kind == "nvfp4"

    def fused_silu_bf16(self) -> bool:
        """Whether batch 1 runs a BF16 gate_up with silu·mul in its epilogue (gemv_bf16 silu):
        BF16 gate_up and down_proj, whose GEMV reads the bf16 product as it is."""
        return self.gate_up is not None and self.gate_up.linear.kind == "bf16" and self.down_proj.kind == "bf16"

    def input_linears(self) -> list[QuantLinear]:
        return [self.gate_up.linear] if self.gate_up is not None else [self.gate_proj, self.up_proj]

    def tile_keys(self) -> list[tuple]:
        if self.fused_silu():
            keys = self.gate_up.linear.tile_keys(m1_kind="nvfp4_silu")
        else:
            keys = [key for lin in self.input_linears() for key in lin.tile_keys()]
        return keys + self.down_proj.tile_keys()

    def forward(self, x: torch.Tensor, x_q: tuple | None = None, partials: bool = False):
        """partials: down_proj's output may come back unreduced (QuantLinear.forward)."""
        down = self.down_proj
        fused = self.gate_up is not None and (self.gate_up.linear.m1_interleaved or self.fused_silu_bf16())
        if fused and x.numel() == x.shape[-1] and down.uses_kernels(x):  # batch 1: silu·mul in gate_up's epilogue
            gate_up = self.gate_up.linear
            if gate_up.m1_interleaved:  # NVFP4: down_proj's activation pairs straight from the epilogue
                if x_q is None or x_q[0].dtype != torch.int32:
                    from ..kernels.gemv_nvfp4 import nvfp4_x_pairs

                    x_q = nvfp4_x_pairs(x.reshape(1, -1).contiguous())
                y = down.forward_pairs(gate_up.forward_silu_pairs(x_q), partials)
            else:
                y = down.forward_kernels(gate_up.forward_silu_bf16(x.reshape(1, -1)), None, partials)
            return y if isinstance(y, Partials) else y.reshape(*x.shape[:-1], -1)
        gate, up = self.gate_up(x, x_q) if self.gate_up is not None else (self.gate_proj(x, x_q), self.up_proj(x, x_q))
        if down.uses_kernels(x):
            from ..kernels.silu_mul_quant import silu_mul_quant

            m1, pdl = x.shape[0] == 1, self.kernels.pdl
            if down.kind == "fp8":  # silu·mul and the per-token FP8 quantization down_proj needs, in one pass
                return down.forward_kernels(x, silu_mul_quant(gate, up, "fp8", half=m1, pdl=pdl), partials)
            if down.kind == "nvfp4" and m1:  # and the activation pairs its batch-1 GEMV reads
                h, pairs = silu_mul_quant(gate, up, "bf16", pairs=True, pdl=pdl)
                return down.forward_kernels(h, pairs, partials)
            return down.forward_kernels(silu_mul_quant(gate, up, "bf16", pdl=pdl), None, partials)
        if self.kernels is not None:  # prefill rows [n, I]: silu·mul in one pass, with down_proj's FP8 input form
            from ..kernels.silu_mul_quant import silu_mul_quant

            if down.kind == "fp8":
                return down.forward_w8a8(None, silu_mul_quant(gate, up, "fp8", pdl=self.kernels.pdl))
            return down(silu_mul_quant(gate, up, "bf16", pdl=self.kernels.pdl))
        return down(F.silu(gate) * up)
