"""Qwen3.5's multi-token-prediction (MTP) layer, with the checkpoint's `mtp.*` tensor names.

A Qwen3.5 checkpoint carries one MTP layer beside the model (`text_config.mtp_num_hidden_layers`
= 1). transformers does not load it (`_keys_to_ignore_on_load_unexpected = ["^mtp.*"]`); vLLM's
`Qwen3_5MTP` (vllm/model_executor/models/qwen3_5_mtp.py) drafts with it, and so will our runtime's
speculative decoding (#55). At position t it takes the main model's last hidden state h_t (after
the final norm: what the model returns) and the embedding of token t+1, and predicts token t+2:

    x = fc(cat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)))   # 2H -> H, no bias
    x = layers[0](x)             # a full-attention decoder layer (gated attention + MLP), causal
    logits_{t+2} = lm_head(norm(x))   # the model's own (tied) embedding and head

Names, exactly as vLLM loads them: mtp.fc.weight, mtp.pre_fc_norm_embedding.weight,
mtp.pre_fc_norm_hidden.weight, mtp.layers.0.{input_layernorm, post_attention_layernorm}.weight,
mtp.layers.0.self_attn.{q_proj, k_proj, v_proj, o_proj, q_norm, k_norm}.weight,
mtp.layers.0.mlp.{gate_proj, up_proj, down_proj}.weight, mtp.norm.weight. The norms are Qwen3.5's
zero-centred RMSNorm (x * (1 + w)), as everywhere in the model.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

MTP_SHARD = "model-mtp.safetensors"


def mtp_text_config(text_config):
    """The text config of the MTP layer: one full-attention layer of the model's shapes."""
    cfg = copy.deepcopy(text_config)
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["full_attention"]
    cfg._attn_implementation = "sdpa"  # forward passes no mask: causal on this path only, however the config was loaded
    return cfg


class Qwen35MTP(nn.Module):
    """One MTP layer; `forward` gives the hidden states its (shared) LM head reads."""

    def __init__(self, text_config):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        h, eps = text_config.hidden_size, text_config.rms_norm_eps
        cfg = mtp_text_config(text_config)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(cfg, 0)])
        self.norm = Qwen3_5RMSNorm(h, eps=eps)
        std = getattr(text_config, "initializer_range", 0.02)
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=std)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """next_embeds [B, L, H]: embeddings of tokens 1..L (input position t holds token t+1);
        hidden [B, L, H]: the model's final hidden states at 0..L-1; position_embeddings: the
        model's rotary (cos, sin) for positions 0..L-1. Returns [B, L, H], position t predicting token t+2.
        Causal over the sequence (no mask: transformers' SDPA path, which mtp_text_config sets, is causal
        without one)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        for layer in self.layers:
            x = layer(x, position_embeddings=position_embeddings, attention_mask=None, position_ids=None)
        return self.norm(x)

    def chain(self, next_embeds: torch.Tensor, hidden: torch.Tensor,
              position_embeddings: tuple[torch.Tensor, torch.Tensor], steps: int) -> list[torch.Tensor]:
        """`steps` chained draft steps at every position at once (training the drafter for k > 1), each
        exactly as speculative decoding runs it: step j at position s reads, instead of the model's
        hidden state, step j-1's output at s-1, and attends to step 1's keys up to s-j+1, then to
        step m's key at s-j+m for m = 2..j (the cache a draft chain sees: verified positions, then
        its own). next_embeds / hidden / position_embeddings as forward's; returns each step's
        output [B, L, H] (step 1 is forward's; step j at position s predicts token s+2, given
        tokens up to s+1 whose last j-1 were drafted)."""
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

        if len(self.layers) != 1:
            raise ValueError("chain: one MTP decoder layer")
        layer = self.layers[0]
        attn = layer.self_attn
        cos, sin = position_embeddings
        b, n, _ = next_embeds.shape
        e = self.pre_fc_norm_embedding(next_embeds)
        s = torch.arange(n, device=next_embeds.device)[:, None]  # query positions; keys i, by step
        i = s.T
        keys, values, outs, h = [], [], [], hidden
        for j in range(1, steps + 1):
            if j > 1:  # position s reads the previous step's output at s-1 (position 0 has none: zeros)
                h = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)
            x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(h)], dim=-1))
            y = layer.input_layernorm(x)
            q, gate = torch.chunk(attn.q_proj(y).view(b, n, -1, attn.head_dim * 2), 2, dim=-1)
            q = attn.q_norm(q).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(y).view(b, n, -1, attn.head_dim)).transpose(1, 2)
            v = attn.v_proj(y).view(b, n, -1, attn.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys.append(k)
            values.append(v)
            mask = torch.cat([i <= s - j + 1] + [i == s - j + m for m in range(2, j + 1)], dim=1)  # [L, j·L]
            o = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                               scale=attn.scaling, enable_gqa=True)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, n, -1) * torch.sigmoid(gate.reshape(b, n, -1)))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            outs.append(self.norm(x))
        return outs

    def checkpoint_tensors(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        return {f"mtp.{k}": v.detach().to(dtype).contiguous().cpu() for k, v in self.state_dict().items()}


def save_mtp(model_dir: Path, mtp: Qwen35MTP, dtype: torch.dtype = torch.bfloat16) -> int:
    """Write the MTP layer into a saved model directory as its own shard, listed in the index, and
    record `mtp_num_hidden_layers` in config.json's text_config (as Qwen3.5 checkpoints do)."""
    model_dir = Path(model_dir)
    tensors = mtp.checkpoint_tensors(dtype)
    add_shard(model_dir, MTP_SHARD, tensors)
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("text_config", {})["mtp_num_hidden_layers"] = len(mtp.layers)
    cfg["text_config"]["mtp_use_dedicated_embeddings"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return len(tensors)


def mtp_keys(model_dir: Path) -> list[str]:
    """The mtp.* tensor names a model directory holds (safetensors headers only, nothing loaded)."""
    from safetensors import safe_open

    keys = set()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            keys.update(k for k in fh.keys() if k.startswith("mtp."))
    return sorted(keys)


def load_mtp(model_dir: Path, text_config, dtype: torch.dtype = torch.float32) -> Qwen35MTP | None:
    """The MTP layer of a model directory (None if it has no mtp.* tensors)."""
    from safetensors import safe_open

    state = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if k.startswith("mtp."):
                    state[k[len("mtp."):]] = fh.get_tensor(k)
    if not state:
        return None
    mtp = Qwen35MTP(text_config)
    mtp.load_state_dict(state)
    return mtp.to(dtype)


def add_shard(model_dir: Path, shard: str, tensors: dict[str, torch.Tensor], fmt: str = "pt") -> None:
    """Write `tensors` into a saved model directory as their own safetensors shard, listed in the
    index (written for a one-file model, so that loaders see both files)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ..files import plain_mode

    model_dir = Path(model_dir)
    save_file(tensors, str(model_dir / shard), metadata={"format": fmt})
    plain_mode(model_dir / shard)
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        with safe_open(str(model_dir / "model.safetensors"), "pt") as fh:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in fh.keys()}}
    index["weight_map"].update({k: shard for k in tensors})
    index.setdefault("metadata", {})["total_size"] = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
