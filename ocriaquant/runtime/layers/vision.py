"""The vision tower's attention for the triton backend: transformers' Qwen3_5VisionAttention with
its rotary embedding and the layout SDPA reads made by one kernel (kernels/vision_rope.py) from
the qkv projection's output; the projections, SDPA and the per-image split are transformers'.
The torch backend keeps transformers' module."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VisionAttention(nn.Module):
    """In place of a vision block's `attn` (its qkv and proj Linears kept): same inputs, same math."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.qkv, self.proj = attn.qkv, attn.proj
        self.heads, self.scaling = attn.num_heads, attn.scaling

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], **kwargs) -> torch.Tensor:
        from ..kernels.vision_rope import vision_rope

        S = hidden_states.shape[0]
        q, k, v = vision_rope(self.qkv(hidden_states), *position_embeddings, self.heads)  # [1, H, S, D] each
        bounds = cu_seqlens.tolist()  # the runtime hands them from the host: no sync (models/qwen3_5.encode)
        outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=self.scaling)
                for a, b in zip(bounds, bounds[1:])]
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return self.proj(o[0].transpose(0, 1).reshape(S, -1))
