"""The checkpoint's multi-token-prediction layer (`mtp.*`, model/mtp.py gives the math and the
names as vLLM loads them) as the drafter of speculative decoding (#55), built from the tensor
store like the decoder and run on the runtime's own layers, with its own per-slot KV cache.

At position t it reads the target's final hidden state h_t (after the final norm) and the
embedding of token t+1 (a prompt's own embeddings, image features in place, at prompt positions)
and gives the hidden state whose head logits predict token t+2; chained on its own output, it
drafts k tokens. Its KV entries at a position are those of the target's position (same M-RoPE)."""

from __future__ import annotations

import torch
from torch import nn

from ...quant import fp8
from ..config import Kernels
from ..layers import MLP, Attention, Chunk, QuantLinear, RMSNorm, Step
from ..load import read_linear

PREFIX = "mtp."
DRAFT_HEADS = ("bf16", "fp8")


def has_mtp(store) -> bool:
    """Whether a tensor store holds an MTP layer (its fc, in any format)."""
    return any(k in store for k in ("mtp.fc.weight", "mtp.fc.weight_packed"))


class MTP(nn.Module):
    """One MTP layer: fc(cat(pre_fc_norm_embedding(e), pre_fc_norm_hidden(h))) → a full-attention
    decoder layer (gated attention + MLP, the decoder's own classes) → norm. The head is the
    runner's (draft_head: the model's LM head, or a cheaper one). fmt "fp8": the Linears the
    checkpoint holds in BF16 are quantized at load (per-channel E4M3, per-token activations), which
    halves what each draft step reads; it changes which drafts are proposed, never the output."""

    def __init__(self, config, store, kinds: dict[str, str], dtype: torch.dtype = torch.bfloat16,
                 kernels: Kernels | None = None, fmt: str = "bf16"):
        super().__init__()
        if fmt not in DRAFT_HEADS:
            raise ValueError(f"drafter format must be one of {DRAFT_HEADS}, got {fmt!r}")
        tc = config.text_config
        eps = tc.rms_norm_eps

        def lin(name):
            key = PREFIX + name
            if fmt == "fp8" and kinds.get(key) is None:
                q, s = fp8.quantize_weight(store.require([key + ".weight"])[key + ".weight"].to(torch.bfloat16), key)
                return QuantLinear("fp8", q, s, dtype=dtype, kernels=kernels)
            return read_linear(store, key, kinds.get(key), dtype, kernels)

        def norm(name):
            return RMSNorm(store.require([PREFIX + name])[PREFIX + name].to(dtype), eps)

        a = "layers.0.self_attn."
        self.fc = lin("fc")
        self.pre_fc_norm_embedding = norm("pre_fc_norm_embedding.weight")
        self.pre_fc_norm_hidden = norm("pre_fc_norm_hidden.weight")
        qk = store.require([PREFIX + a + "q_norm.weight", PREFIX + a + "k_norm.weight"])
        self.attn = Attention(tc, {k[len(PREFIX + a):]: v.to(dtype) for k, v in qk.items()},
                              {n: lin(a + n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
        self.mlp = MLP(*(lin(f"layers.0.mlp.{n}") for n in ("gate_proj", "up_proj", "down_proj")))
        self.input_layernorm = norm("layers.0.input_layernorm.weight")
        self.post_attention_layernorm = norm("layers.0.post_attention_layernorm.weight")
        self.norm = norm("norm.weight")

    def alloc_state(self, slots: int, max_len: int, device, dtype) -> dict:
        return self.attn.alloc_state(slots, max_len, device, dtype)

    def _fc(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))

    @torch.no_grad()
    def prefill(self, embeds: torch.Tensor, hidden: torch.Tensor, state: dict, chunks: list[Chunk],
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A prefill pass's rows (as Qwen3_5.prefill's chunks): embeds [sum n, D] of each position's
        next token, hidden [sum n, D] the target's normed hidden states -> [sum n, D] (normed)."""
        x = self._fc(embeds, hidden)
        x = x + self.attn.prefill(self.input_layernorm(x), state, chunks, cos, sin)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.norm(x)

    @torch.no_grad()
    def decode(self, embeds: torch.Tensor, hidden: torch.Tensor, state: dict, step: Step) -> torch.Tensor:
        """Decode-style rows (Qwen3_5.step; several rows of a slot at consecutive positions allowed)
        -> [R, D] (normed)."""
        x = self._fc(embeds, hidden)
        x = x + self.attn.decode(self.input_layernorm(x), state, step)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.norm(x)


def draft_head(lm_head: QuantLinear, fmt: str = "bf16", vocab: int = 0, keep: tuple[int, ...] = (),
               kernels: Kernels | None = None) -> tuple[QuantLinear, torch.Tensor | None]:
    """The head drafts are scored with: (Linear, the token id of each of its rows, or None for all).

    The tied head of the 4B is 0.64 B parameters, 4.4x the MTP layer: scored k times a step in
    BF16 it would cost more than the verify. What the field does: a reduced draft vocabulary
    (FR-Spec, EAGLE-3's draft vocab: `vocab` rows, the lowest ids — byte-level BPE numbers its
    tokens in merge order, frequent first — plus `keep`, e.g. EOS) and / or a quantized head
    (`fmt` fp8: per-channel E4M3 weights, per-token activations). Either changes only which
    drafts are proposed, never the output: the verify scores every draft with the full head."""
    if fmt not in DRAFT_HEADS:
        raise ValueError(f"draft head format must be one of {DRAFT_HEADS}, got {fmt!r}")
    w, ids = lm_head.weight, None
    if vocab and vocab < w.shape[0]:
        ids = torch.tensor(sorted(set(range(vocab)) | {int(t) for t in keep if 0 <= int(t) < w.shape[0]}),
                           device=w.device)
        w = w[ids]
    if fmt == "bf16":
        return (lm_head if ids is None else QuantLinear("bf16", w, dtype=w.dtype, kernels=kernels)), ids
    q, s = fp8.quantize_weight(w.to(torch.bfloat16), "draft head")
    return QuantLinear("fp8", q, s, dtype=w.dtype, kernels=kernels), ids
