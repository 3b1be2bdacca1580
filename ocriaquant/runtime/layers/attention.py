"""Qwen3.5's gated full attention, its keys and values in a static per-slot cache
[slots, KV heads, max_len, head_dim]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import FusedLinear, QuantLinear
from .norm import RMSNorm
from .step import Chunk, Step, slot_rows


class Attention(nn.Module):
    """q_proj also yields a sigmoid output gate; M-RoPE on a partial head dim; GQA. With kernels
    (the triton backend) q/k/v run as one weight stream when they share a format, and a decode
    step is two launches from q/k/v to the gated output (qk_norm_rope, attn_decode)."""

    def __init__(self, cfg, p: dict, linears: dict[str, QuantLinear]):
        super().__init__()
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.o_proj = linears["o_proj"]
        self.kernels = self.o_proj.kernels
        self.q_norm = RMSNorm(p["q_norm.weight"], cfg.rms_norm_eps)
        self.k_norm = RMSNorm(p["k_norm.weight"], cfg.rms_norm_eps)
        parts = [linears[n] for n in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = FusedLinear.of(parts) if self.kernels else None
        if self.qkv_proj is None:  # fused, the parts' weights live in qkv_proj only
            self.q_proj, self.k_proj, self.v_proj = parts

    def input_linears(self) -> list[QuantLinear]:
        return [self.qkv_proj.linear] if self.qkv_proj is not None else [self.q_proj, self.k_proj, self.v_proj]

    def tile_keys(self) -> list[tuple]:
        return [key for lin in self.input_linears() for key in lin.tile_keys()] + \
            self.o_proj.tile_keys(quantizes_input=True)

    def alloc_state(self, slots: int, max_len: int, device, dtype) -> dict:
        shape = (slots, self.kv_heads, max_len, self.head_dim)
        return {name: torch.zeros(shape, dtype=dtype, device=device) for name in ("k", "v")}

    def _project(self, x, x_q=None):
        if self.qkv_proj is not None:
            return self.qkv_proj(x, x_q)
        return self.q_proj(x, x_q), self.k_proj(x, x_q), self.v_proj(x, x_q)

    def prefill(self, x, state, chunks: list[Chunk], cos, sin, x_q: tuple | None = None):
        """x [sum n, D]: the rows of several requests' prefill chunks (GatedDeltaNet.prefill);
        cos / sin [sum n, rot]. Each chunk writes its keys and values at [start, start + n) of its
        slot's cache and attends to the slot's first start + n positions, causally. x_q: FP8
        projections' input codes, made by the norm before (QuantLinear.forward_w8a8)."""
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

        total, hd = x.shape[0], self.head_dim
        qg, k, v = self._project(x, x_q)
        q, gate = torch.chunk(qg.reshape(total, -1, hd * 2), 2, dim=-1)
        q = self.q_norm(q).transpose(0, 1)                                     # [heads, sum n, hd]
        k = self.k_norm(k.reshape(total, -1, hd)).transpose(0, 1)
        v = v.reshape(total, -1, hd).transpose(0, 1)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=-3)
        outs, row = [], 0
        for c in chunks:
            rows, end = slice(row, row + c.n), c.start + c.n
            row += c.n
            state["k"][c.slot, :, c.start:end] = k[:, rows]
            state["v"][c.slot, :, c.start:end] = v[:, rows]
            if c.start == 0:  # the chunk is all there is: plain causal attention (flash on a GPU)
                o = F.scaled_dot_product_attention(q[None, :, rows], k[None, :, rows], v[None, :, rows],
                                                   is_causal=True, enable_gqa=True)[0]
            else:  # query i sits at start + i and sees the cache up to there
                keys, vals = state["k"][c.slot, :, :end], state["v"][c.slot, :, :end]
                seen = torch.arange(end, device=x.device)[None] <= c.start + torch.arange(c.n, device=x.device)[:, None]
                o = F.scaled_dot_product_attention(q[None, :, rows], keys[None], vals[None], attn_mask=seen,
                                                   enable_gqa=True)[0]
            outs.append(o.transpose(0, 1).reshape(c.n, -1))
        return self.o_proj(torch.cat(outs) * torch.sigmoid(gate.reshape(total, -1)))

    def decode(self, x, state, step: Step, x_q: tuple | None = None, partials: bool = False):
        """x [B, D]: one token per slot at position lengths[b] of its cache (partials: as
        GatedDeltaNet.decode, for o_proj). The torch path attends over the prefix any row can
        see (step.span); the kernels read the cache in place, with no host sync, so the step can
        be a CUDA graph."""
        b, hd = x.shape[0], self.head_dim
        qg, k, v = self._project(x, x_q)
        qg = qg.reshape(b, -1, 2 * hd)  # per head: q, then its output gate
        if self.kernels:
            from ..kernels.attn_decode import attn_decode
            from ..kernels.qk_norm_rope import qk_norm_rope

            pdl = self.kernels.pdl
            q = qk_norm_rope(qg[:, :, :hd], k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, step.cos,
                             step.sin, state["k"], state["v"], step.slots32, step.lengths32, pdl=pdl)
            # An FP8 o_proj's input: above batch 1 quantized in the merge launch, at batch 1 quantized
            # inside o_proj's GEMV from the absmax parts the merge writes (as gdn_decode does)
            quant = self.o_proj.producer_quant(x)
            o = attn_decode(q, state["k"], state["v"], step.slots32, step.lengths32, hd ** -0.5, gate=qg[:, :, hd:],
                            quant=quant, pdl=pdl)
            o, o_q = (o, None) if quant is None else o
            return self.o_proj(o.reshape(b, -1), o_q, partials)
        from ..kernels.reference import qk_norm_rope_ref

        q = qk_norm_rope_ref(qg[:, :, :hd], k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, step.cos,
                             step.sin, state["k"], state["v"], step.slots, step.lengths)
        span = step.span
        keys, vals = (slot_rows(state[n][:, :, :span], step) for n in ("k", "v"))  # [B, kv, span, hd]
        visible = torch.arange(span, device=x.device)[None, :] <= step.lengths[:, None]
        o = F.scaled_dot_product_attention(q[:, :, None], keys, vals, attn_mask=visible[:, None, None, :],
                                           enable_gqa=True)
        return self.o_proj(o[:, :, 0].reshape(b, -1) * torch.sigmoid(qg[:, :, hd:].reshape(b, -1)))
