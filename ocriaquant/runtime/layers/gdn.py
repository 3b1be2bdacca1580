"""The gated delta net token mixer (Qwen3.5's linear attention), its state in per-slot buffers.

The torch path calls transformers' own torch functions for the delta rule (chunked for prefill,
recurrent for decode): the same math transformers runs, fed from and written back to our slot
buffers. The recurrent state is fp32 [slots, HV, V, K]; transformers keeps [.., K, V], so it is
transposed on the way in and out. Conv state: [slots, C, kernel - 1]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import FusedLinear, QuantLinear
from .norm import gated_rmsnorm
from .step import Step


def depthwise_causal_conv_silu(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[.., C, kernel] windows · [C, kernel] weights -> silu(conv) in the input dtype.

    The same sum F.conv1d computes, written out: on the CPU a depthwise F.conv1d in BF16 falls
    to a per-channel slow path (about 1 s per decode step of the bundled model)."""
    y = (window.float() * weight.float()).sum(-1).to(window.dtype)
    return F.silu(y)


def chunk_rule(gpu_kernels: bool):
    """The chunked gated delta rule for prefill: fla-core's Triton kernel when the triton
    backend runs on a GPU and fla-core is installed, else transformers' torch function — the
    same math, what the torch backend must match."""
    if gpu_kernels:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            return chunk_gated_delta_rule
        except ImportError:
            pass
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule


class GatedDeltaNet(nn.Module):
    """A GDN token mixer whose conv and recurrent states are rows of per-slot buffers. With
    kernels (the triton backend) its four input projections run as one weight stream when they
    share a format (else qkv+z and a+b where those do), and a decode step's GDN is one
    gdn_decode launch."""

    INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")

    def __init__(self, cfg, p: dict, linears: dict[str, QuantLinear]):
        super().__init__()
        self.H, self.HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.K, self.V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.eps = cfg.rms_norm_eps
        self.out_proj = linears["out_proj"]
        self.kernels = self.out_proj.kernels
        self.register_buffer("conv_weight", p["conv1d.weight"].squeeze(1))  # [C, kernel]
        self.register_buffer("A_log", p["A_log"])
        self.register_buffer("dt_bias", p["dt_bias"])
        self.register_buffer("norm_weight", p["norm.weight"])
        self.conv_dim = 2 * self.H * self.K + self.HV * self.V
        self.kernel = self.conv_weight.shape[-1]
        self.fused: list[tuple[FusedLinear, list[str]]] = []

        def fuse(group):
            f = FusedLinear.of([linears[n] for n in group])
            if f is not None:
                self.add_module("fused_" + "_".join(n[len("in_proj_"):] for n in group), f)
                self.fused.append((f, list(group)))
            return f

        if self.kernels and fuse(self.INPUTS) is None:
            fuse(self.INPUTS[:2])
            fuse(self.INPUTS[2:])
        fused = {n for _, group in self.fused for n in group}
        for n in self.INPUTS:
            if n not in fused:
                self.add_module(n, linears[n])

    def input_linears(self) -> list[QuantLinear]:
        return [f.linear for f, _ in self.fused] + [getattr(self, n) for n in self.INPUTS if hasattr(self, n)]

    def tile_keys(self) -> list[tuple]:
        return [key for lin in self.input_linears() for key in lin.tile_keys()] + \
            self.out_proj.tile_keys(quantizes_input=True)

    def _proj(self, x: torch.Tensor, x_q: tuple | None = None) -> dict[str, torch.Tensor]:
        out = {}
        for f, group in self.fused:
            out.update(zip(group, f(x, x_q)))
        for n in self.INPUTS:
            if n not in out:
                out[n] = getattr(self, n)(x, x_q)
        return out

    def alloc_state(self, slots: int, device, dtype) -> dict:
        return {"conv": torch.zeros(slots, self.conv_dim, self.kernel - 1, dtype=dtype, device=device),
                "ssm": torch.zeros(slots, self.HV, self.V, self.K, dtype=torch.float32, device=device)}

    def _qkv_gates(self, p, mixed):
        t = mixed.shape[:-1]
        q, k, v = torch.split(mixed, [self.H * self.K, self.H * self.K, self.HV * self.V], dim=-1)
        q, k = q.reshape(*t, self.H, self.K), k.reshape(*t, self.H, self.K)
        v = v.reshape(*t, self.HV, self.V)
        beta = p["in_proj_b"].sigmoid()
        g = -self.A_log.float().exp() * F.softplus(p["in_proj_a"].float() + self.dt_bias)
        if self.HV // self.H > 1:
            q = q.repeat_interleave(self.HV // self.H, dim=-2)
            k = k.repeat_interleave(self.HV // self.H, dim=-2)
        return q, k, v, g, beta

    def _out(self, core: torch.Tensor, x: torch.Tensor, p: dict) -> torch.Tensor:
        z = p["in_proj_z"].reshape(-1, self.V)
        o = gated_rmsnorm(core.reshape(-1, self.V), z, self.norm_weight, self.eps)
        return self.out_proj(o.reshape(*x.shape[:-1], -1))

    def prefill(self, x: torch.Tensor, state: dict, slot: int) -> torch.Tensor:
        """x [T, D] of one request -> [T, D]; writes the slot's conv and recurrent state."""
        p = self._proj(x)
        mixed = p["in_proj_qkv"].T  # [C, T]
        padded = F.pad(mixed, (self.kernel - 1, 0))                                  # zero history
        state["conv"][slot].copy_(padded[:, -(self.kernel - 1):])
        mixed = depthwise_causal_conv_silu(padded.unfold(1, self.kernel, 1), self.conv_weight[:, None]).T  # [T, C]
        q, k, v, g, beta = self._qkv_gates(p, mixed)
        core, final = chunk_rule(self.kernels is not None and x.is_cuda)(
            q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=None, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        state["ssm"][slot].copy_(final[0].transpose(-1, -2))  # [HV, K, V] -> our [HV, V, K]
        return self._out(core[0].to(x.dtype), x, p)

    def decode(self, x: torch.Tensor, state: dict, step: Step, x_q: tuple | None = None, partials: bool = False):
        """x [B, D], one token per slot -> [B, D]; the slots' states advance in place. partials:
        out_proj's output may come back unreduced (QuantLinear.forward; kernels only)."""
        p = self._proj(x, x_q)
        if self.kernels:
            from ..kernels.gdn_decode import gdn_decode

            # An FP8 out_proj's input comes from gdn_decode itself: above batch 1 quantized there (one
            # launch fewer), at batch 1 as its absmax in parts, out_proj's GEMV quantizing its own slices.
            quant = self.out_proj.producer_quant(x)
            o = gdn_decode(p["in_proj_qkv"], p["in_proj_z"], p["in_proj_a"], p["in_proj_b"], state["conv"],
                           self.conv_weight, self.A_log, self.dt_bias, self.norm_weight, state["ssm"], step.slots32,
                           self.H, self.K, self.V, self.eps, quant=quant, pdl=self.kernels.pdl)
            o, o_q = (o, None) if quant is None else o
            return self.out_proj(o, o_q, partials)
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

        slots = step.slots
        window = torch.cat([state["conv"][slots], p["in_proj_qkv"][:, :, None]], dim=-1)  # [B, C, kernel]
        state["conv"].index_copy_(0, slots, window[:, :, 1:].contiguous())
        mixed = depthwise_causal_conv_silu(window, self.conv_weight)
        q, k, v, g, beta = self._qkv_gates(p, mixed)
        s = state["ssm"][slots].transpose(-1, -2)  # [B, HV, K, V] as transformers keeps it
        core, new = torch_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g=g[:, None],
                                                     beta=beta[:, None], initial_state=s, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
        state["ssm"].index_copy_(0, slots, new.transpose(-1, -2).contiguous())
        return self._out(core[:, 0], x, p)
