"""Teacher-forced forward of a batch of same-size pages with one prompt, at static shapes.

transformers' Qwen3.5 forward is written for ragged inputs: per-image Python loops in the
vision attention and the M-RoPE index, host syncs to split image features. For training the
reference model and for calibration every page has the same size and the same prompt, so
all of that is computed once here: the 3-D positions, the vision rotary angles and the
position-embedding interpolation. The vision attention then runs batched across pages.
Every weight is used through the model's own modules, so the logits equal transformers'
forward (tests/test_batched.py), and the step has no host sync, so it can be captured in a
CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from .processor import SYSTEM_PROMPT, PageProcessor, chat_text


def patchify(images: torch.Tensor, patch: int, merge: int, temporal: int, mean: torch.Tensor,
             std: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] uint8 or float in [0, 255] -> [B, N, 3*T*P*P] normalized patches, in the
    order Qwen2VLImageProcessor emits them (merge blocks row-major, then pixels in a patch).
    `mean`/`std` are [3] tensors on the images' device (a host->device copy here would break
    CUDA-graph capture)."""
    b, c, h, w = images.shape
    x = images.float() / 255.0
    x = (x - mean.view(1, c, 1, 1)) / std.view(1, c, 1, 1)
    gh, gw = h // patch, w // patch
    x = x.view(b, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)  # b, gh/m, gw/m, mh, mw, C, ph, pw
    x = x.unsqueeze(6).expand(*x.shape[:6], temporal, patch, patch)
    return x.reshape(b, gh * gw, c * temporal * patch * patch)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PageBatchForward(nn.Module):
    """Hidden states (or logits) for B pages of `image_hw` followed by `text_len` target tokens."""

    def __init__(self, model: nn.Module, processor: PageProcessor, image_hw: tuple[int, int], text_len: int,
                 prompt: str, system: str | None = SYSTEM_PROMPT):
        super().__init__()
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

        self.model = model
        h, w = image_hw
        enc = processor(images=[Image.new("RGB", (w, h), "white")], text=[chat_text(processor, prompt, system)],
                        return_tensors="pt")
        grid = enc["image_grid_thw"]
        if tuple(int(v) for v in grid[0, 1:] * processor.image_processor.patch_size) != (h, w):
            raise ValueError(f"pages of {w}x{h} px would be resized by the processor; use a multiple of "
                             f"{processor.image_processor.patch_size * processor.image_processor.merge_size} px "
                             "within its max_pixels")
        ip = processor.image_processor
        self.patch, self.merge, self.temporal = ip.patch_size, ip.merge_size, ip.temporal_patch_size
        self.register_buffer("mean", torch.tensor(ip.image_mean, dtype=torch.float32), persistent=False)
        self.register_buffer("std", torch.tensor(ip.image_std, dtype=torch.float32), persistent=False)
        prefix = enc["input_ids"][0]
        image_id = model.config.image_token_id
        img_pos = (prefix == image_id).nonzero().flatten()
        self.img_start, self.img_end = int(img_pos[0]), int(img_pos[-1]) + 1
        self.text_len = text_len
        self.register_buffer("prefix_ids", prefix, persistent=False)

        full_ids = torch.cat([prefix, torch.zeros(text_len, dtype=prefix.dtype)])[None]
        mm = torch.cat([enc["mm_token_type_ids"][0], torch.zeros(text_len, dtype=torch.long)])[None]
        pos, _ = model.model.get_rope_index(full_ids, mm, image_grid_thw=grid)
        self.register_buffer("position_ids", pos, persistent=False)  # [3, 1, L]

        visual = model.model.visual
        idx, wts = get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.spatial_merge_size)
        self.register_buffer("interp_idx", idx, persistent=False)
        self.register_buffer("interp_w", wts, persistent=False)
        self.register_buffer("vis_pos", get_vision_position_ids(grid, visual.spatial_merge_size), persistent=False)

    @property
    def prefix_len(self) -> int:
        return self.prefix_ids.numel()

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        return patchify(images, self.patch, self.merge, self.temporal, self.mean, self.std)

    def vision(self, patches: torch.Tensor) -> torch.Tensor:
        """[B, N, patch_dim] -> [B, N / merge^2, text hidden]"""
        v = self.model.model.visual
        b, n, _ = patches.shape
        x = v.patch_embed(patches.reshape(b * n, -1)).view(b, n, -1)
        pos = (v.pos_embed(self.interp_idx) * self.interp_w[:, :, None].to(x.dtype)).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = v.rotary_pos_emb(x, self.vis_pos)  # [N, head_dim], fp32
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        for blk in v.blocks:
            attn = blk.attn
            h = blk.norm1(x)
            q, k, val = attn.qkv(h).view(b, n, 3, attn.num_heads, attn.head_dim).unbind(2)
            # Rotary in fp32 as transformers does, then back to the activation dtype.
            qf, kf = q.float(), k.float()
            q = (qf * cos + _rotate_half(qf) * sin).to(val.dtype)
            k = (kf * cos + _rotate_half(kf) * sin).to(val.dtype)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), val.transpose(1, 2),
                                               scale=attn.scaling)
            x = x + attn.proj(o.transpose(1, 2).reshape(b, n, -1))
            x = x + blk.mlp(blk.norm2(x))
        return v.merger(x.reshape(b * n, -1)).view(b, n // self.merge**2, -1)

    def embeds_hidden(self, images: torch.Tensor, text_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """images [B, 3, H, W] (0..255), text_ids [B, text_len] -> (input embeddings with the image
        features in place, last hidden) [B, L, D] each: what the MTP layer reads."""
        b = images.shape[0]
        img = self.vision(self.pixels(images))
        embed = self.model.model.language_model.embed_tokens
        ids = torch.cat([self.prefix_ids.expand(b, -1), text_ids], dim=1)
        emb = embed(ids)
        emb = torch.cat([emb[:, : self.img_start], img.to(emb.dtype), emb[:, self.img_end:]], dim=1)
        out = self.model.model.language_model(inputs_embeds=emb, position_ids=self.position_ids.expand(-1, b, -1),
                                              use_cache=False)
        return emb, out.last_hidden_state

    def hidden(self, images: torch.Tensor, text_ids: torch.Tensor) -> torch.Tensor:
        """images [B, 3, H, W] (0..255), text_ids [B, text_len] -> last hidden [B, L, D]."""
        return self.embeds_hidden(images, text_ids)[1]

    def forward(self, images: torch.Tensor, text_ids: torch.Tensor) -> torch.Tensor:
        """Logits predicting each text token: [B, text_len, vocab] (position i predicts text_ids[:, i])."""
        hid = self.hidden(images, text_ids)
        return self.model.lm_head(hid[:, self.prefix_len - 1: -1])
