"""The Qwen3.5 text decoder assembled from a tensor store, plus transformers' vision tower in
BF16: prompts encoded (vision tower, embeddings, M-RoPE positions), prefill passes over chunks of
several prompts, and the per-layer decode forward. The state buffers it reads and
writes belong to the caller (ModelRunner)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import OcriaError
from ..config import Kernels
from ..layers import MLP, Attention, Chunk, GatedDeltaNet, QuantLinear, RMSNorm, Step
from ..layers.step import in_order
from ..layers.vision import VisionAttention
from ..load import TEXT, read_linear

GDN_LINEARS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")


def vision_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """The vision tower's attention segments (one a frame: h * w patches each) as cumulative
    bounds [0, n0, n0 + n1, ...], int32, computed where grid_thw lives (transformers' convention)."""
    sizes = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return torch.nn.functional.pad(sizes.cumsum(0, dtype=torch.int32), (1, 0))


@dataclass
class Prompt:
    """A request ready for prefill: its embeddings [T, D] (image features in place), M-RoPE
    positions [3, T] and the delta its decode positions are offset by."""
    embeds: torch.Tensor
    positions: torch.Tensor
    delta: int

    @property
    def length(self) -> int:
        return self.embeds.shape[0]


class _RopeIndex:
    """transformers' M-RoPE position builder (Qwen3_5Model.get_rope_index) without the model."""

    def __init__(self, config):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

        self.config = config
        self._model_cls = Qwen3_5Model

    def __call__(self, input_ids, mm_token_type_ids, image_grid_thw):
        return self._model_cls.get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw)

    def get_vision_position_ids(self, *args, **kwargs):
        return self._model_cls.get_vision_position_ids(self, *args, **kwargs)


class Qwen3_5(nn.Module):
    """Every tensor is held in `dtype` (BF16 by default), as transformers holds a model loaded
    with that dtype — Qwen3.5 keeps no module in fp32 — except the quantized weights' packed
    forms (and the runner's fp32 GDN state). kernels: the triton backend's settings, None for
    torch. `label` names the weights in errors (a checkpoint directory)."""

    def __init__(self, config, store, kinds: dict[str, str], dtype: torch.dtype = torch.bfloat16,
                 kernels: Kernels | None = None, label=None):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding, Qwen3_5VisionModel

        from ...model.route_kernels import route_by_device

        route_by_device()  # the torch path on the CPU calls transformers' GDN functions (layers/gdn.py)
        label = label or store.model_dir
        self.config, self.dtype, self.kernels = config, dtype, kernels
        tc = config.text_config

        def lin(name):
            return read_linear(store, name, kinds.get(name), dtype, kernels)

        def small(prefix, names):  # norms and GDN parameters, keyed without the prefix
            return {k[len(prefix):]: v.to(dtype) for k, v in store.require([prefix + n for n in names]).items()}

        layers = []
        for i, kind in enumerate(tc.layer_types):
            pre = f"{TEXT}layers.{i}."
            if kind == "linear_attention":
                a = pre + "linear_attn."
                mixer = GatedDeltaNet(tc, small(a, ("conv1d.weight", "A_log", "dt_bias", "norm.weight")),
                                      {n: lin(a + n) for n in GDN_LINEARS})
            elif kind == "full_attention":
                a = pre + "self_attn."
                mixer = Attention(tc, small(a, ("q_norm.weight", "k_norm.weight")),
                                  {n: lin(a + n) for n in ATTN_LINEARS})
            else:
                raise OcriaError(f"{label}: layer {i} has type {kind!r}; Qwen3.5 has linear_attention and "
                                 "full_attention layers only")
            norms = small(pre, ("input_layernorm.weight", "post_attention_layernorm.weight"))
            layer = nn.Module()
            layer.mixer = mixer
            layer.mlp = MLP(*(lin(f"{pre}mlp.{n}") for n in ("gate_proj", "up_proj", "down_proj")))
            layer.input_layernorm = RMSNorm(norms["input_layernorm.weight"], tc.rms_norm_eps)
            layer.post_attention_layernorm = RMSNorm(norms["post_attention_layernorm.weight"], tc.rms_norm_eps)
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.embed = nn.Embedding.from_pretrained(store.require([TEXT + "embed_tokens.weight"])[
            TEXT + "embed_tokens.weight"].to(dtype), freeze=True)
        self.norm = RMSNorm(store.require([TEXT + "norm.weight"])[TEXT + "norm.weight"].to(dtype), tc.rms_norm_eps)
        if "lm_head.weight" in store or "lm_head.weight_packed" in store:
            self.lm_head = lin("lm_head")
        else:  # tied embeddings
            self.lm_head = QuantLinear("bf16", self.embed.weight, dtype=dtype, kernels=kernels)
        self.rotary = Qwen3_5TextRotaryEmbedding(tc)
        self.visual = Qwen3_5VisionModel._from_config(config.vision_config, dtype=dtype)
        # transformers' SDPA path splits every layer's attention at the images' bounds with .tolist(),
        # a host sync a layer where they live on the GPU: encode hands them over from the host
        self._host_bounds = "flash" not in str(self.visual.config._attn_implementation)
        vis = {k[len("model.visual."):]: store.get(k) for k in store.where if k.startswith("model.visual.")}
        missing, _ = self.visual.load_state_dict(vis, strict=False)
        if missing:
            raise OcriaError(f"{label}: vision tower tensors missing: {', '.join(sorted(missing)[:5])}")
        if kernels and self._host_bounds and dtype == torch.bfloat16:  # rope + SDPA's layout: one launch a layer
            for block in self.visual.blocks:
                block.attn = VisionAttention(block.attn)
        self.rope_index = _RopeIndex(config)

        # With kernels, norms whose Linears all read FP8 or all NVFP4 (W4A16) write their output in the
        # form those GEMVs read as well (add_rmsnorm's quant), saving a launch or a pass per GEMV.
        def quant_for(linears):
            kinds = {q.kind for q in linears}
            return next(iter(kinds)) if kernels and len(kinds) == 1 and kinds <= {"fp8", "nvfp4"} else None

        self.norm_quant = [(quant_for(layer.mixer.input_linears()), quant_for(layer.mlp.input_linears()))
                           for layer in self.layers]
        self.head_quant = quant_for([self.lm_head])
        self._rope_cos = self._rope_sin = None  # the kernels' rope tables (prepare_kernels)

    def tile_keys(self) -> set[tuple[str, int, int, int]]:
        """(kind, n, k, batch) of every GEMV tile a decode step with kernels can look up."""
        keys = {key for layer in self.layers for part in (layer.mixer, layer.mlp) for key in part.tile_keys()}
        return keys | set(self.lm_head.tile_keys())

    def alloc_state(self, slots: int, max_len: int, device) -> list[dict]:
        """Per layer: the GDN conv and recurrent state or the attention KV cache, for `slots` slots."""
        return [layer.mixer.alloc_state(slots, max_len, device, self.dtype) if isinstance(layer.mixer, Attention)
                else layer.mixer.alloc_state(slots, device, self.dtype) for layer in self.layers]

    @torch.no_grad()
    def prepare_kernels(self, max_len: int) -> None:
        """On the model's device, before any CUDA graph: NVFP4 weights in the batch-1 kernel's bit
        order, and a decode token's cos / sin by position for step_inputs (positions stay below
        max_len: lengths are checked against it, and Qwen3.5's M-RoPE deltas are never positive,
        see prefill); at decode the three M-RoPE sections share the position."""
        for layer in self.layers:
            if layer.mlp.fused_silu():
                layer.mlp.gate_up.linear.pack_m1(interleave=True)
        for m in self.modules():
            if isinstance(m, QuantLinear) and m.kind.startswith("nvfp4") and m.w_m1 is None:
                m.pack_m1()
        device = self.embed.weight.device
        cos, sin = self.rope(torch.arange(max_len, device=device)[None].expand(3, -1))
        self._rope_cos, self._rope_sin = cos.contiguous(), sin.contiguous()

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, N] -> cos, sin [N, rot] in the model dtype, as transformers computes them."""
        dummy = torch.empty(0, dtype=self.dtype, device=positions.device)
        cos, sin = self.rotary(dummy, positions[:, None, :])
        return cos[0], sin[0]

    @torch.no_grad()
    def encode(self, encs: list[dict]) -> list[Prompt]:
        """Processed requests (processor outputs, batch of 1 each) -> their prompts: embeddings
        with the image features in place, M-RoPE positions and delta. The pages' patches go
        through the vision tower in one call (its attention stays within each image)."""
        device = self.embed.weight.device
        ids = [e["input_ids"][0].to(device, non_blocking=True) for e in encs]
        with_img = [i for i, e in enumerate(encs) if "pixel_values" in e]
        feats = {}
        if with_img:
            grid_host = torch.cat([encs[i]["image_grid_thw"] for i in with_img])
            grid = grid_host.to(device, non_blocking=True)
            parts = [encs[i]["pixel_values"] for i in with_img]
            pixels = torch.empty(sum(len(p) for p in parts), parts[0].shape[1], device=device, dtype=self.dtype)
            row = 0
            for p in parts:  # each page straight into its rows: no host-side cat of ~50 MB a page
                pixels[row:row + len(p)].copy_(p, non_blocking=True)
                row += len(p)
            bounds = {"cu_seqlens": vision_cu_seqlens(grid_host)} if self._host_bounds else {}
            img = self.visual(pixels, grid_thw=grid, return_dict=True, **bounds).pooler_output
            merge = self.config.vision_config.spatial_merge_size ** 2
            sizes = [int(encs[i]["image_grid_thw"].prod(-1).sum()) // merge for i in with_img]
            feats = dict(zip(with_img, img.split(sizes)))
        prompts = []
        for i, (enc, tok) in enumerate(zip(encs, ids)):
            x = self.embed(tok)
            if i in feats:  # the image rows and M-RoPE positions worked out on the host: no sync on the tower
                tok_host = enc["input_ids"][0].cpu()
                rows = (tok_host == self.config.image_token_id).nonzero().squeeze(1)
                if len(rows) != feats[i].shape[0]:
                    raise OcriaError(f"{len(rows)} image tokens but {feats[i].shape[0]} image features")
                x.index_copy_(0, rows.to(device, non_blocking=True), feats[i].to(x.dtype))
                pos, delta = self.rope_index(tok_host[None], enc["mm_token_type_ids"].cpu(),
                                             enc["image_grid_thw"].cpu())
                pos, delta = pos[:, 0].to(device, non_blocking=True), int(delta.reshape(-1)[0])
                if delta > 0 and self.kernels:  # image positions take at most one per token: delta <= 0
                    raise OcriaError(f"an M-RoPE delta of {delta} > 0: decode positions would pass the runtime's "
                                     f"rope tables ({self._rope_cos.shape[0]} positions); this is not a Qwen3.5 "
                                     "position layout")
            else:
                pos, delta = torch.arange(tok.numel(), device=device)[None].expand(3, -1), 0
            prompts.append(Prompt(x, pos, delta))
        return prompts

    @torch.no_grad()
    def prefill(self, parts: list[tuple[Prompt, Chunk]], state: list[dict]) -> torch.Tensor:
        """One prefill pass over chunks of several prompts (each chunk: positions [start, start +
        n) of its prompt, into its slot of `state`, continuing what earlier chunks left there),
        their rows run as one batch through the Linears. Returns the logits of each chunk's last
        position [chunks, vocab]."""
        x = self.prefill_hidden(parts, state)
        last = torch.tensor([c.n for _, c in parts], device=x.device).cumsum(0) - 1
        return self.lm_head(self.norm(x[last]))

    @torch.no_grad()
    def prefill_hidden(self, parts: list[tuple[Prompt, Chunk]], state: list[dict]) -> torch.Tensor:
        """prefill's pass without the head: the residual stream after the last layer, every row
        [sum n, D] (speculative decoding's MTP reads all of them, normed)."""
        chunks = [c for _, c in parts]
        x = torch.cat([p.embeds[c.start:c.start + c.n] for p, c in parts])
        cos, sin = self.rope(torch.cat([p.positions[:, c.start:c.start + c.n] for p, c in parts], dim=1))
        if self.kernels:  # each residual add fused with the norm after it, which also writes FP8 inputs' codes
            from ..kernels.add_rmsnorm import add_rmsnorm

            def norm(x, h, norm, quant):
                return add_rmsnorm(x, h, norm.weight, norm.eps, quant if quant == "fp8" else None)
        else:
            def norm(x, h, norm, quant):
                r = x if h is None else x + h
                return r, norm(r)
        h = None
        for layer, st, (mixer_q, mlp_q) in zip(self.layers, state, self.norm_quant):
            x, n, *n_q = norm(x, h, layer.input_layernorm, mixer_q)
            extra = (cos, sin) if isinstance(layer.mixer, Attention) else ()
            h = layer.mixer.prefill(n, st, chunks, *extra, x_q=n_q[0] if n_q else None)
            x, n, *n_q = norm(x, h, layer.post_attention_layernorm, mlp_q)
            h = layer.mlp(n, *n_q)
        return x + h

    def step(self, tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, deltas: torch.Tensor,
             span: int = 0) -> tuple[torch.Tensor, Step]:
        """Decode-style rows' inputs: the tokens' embeddings [B, D] and the Step every layer reads
        (row b at position lengths[b] of its slot; several rows may share a slot at consecutive
        positions: attention writes all their keys before any row reads, so each sees the ones
        before it). With kernels one step_inputs launch."""
        if self.kernels:
            from ..kernels.step_inputs import step_inputs

            x, *meta = step_inputs(tokens, slots, lengths, deltas, self.embed.weight, self._rope_cos, self._rope_sin,
                                   pdl=self.kernels.pdl)
        else:
            from ..kernels.reference import step_inputs_ref

            x, *meta = step_inputs_ref(tokens, slots, lengths, deltas, self.embed.weight, self.rotary, self.dtype)
        return x, Step(slots, lengths, *meta, span, in_order=not self.kernels and in_order(slots))

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, deltas: torch.Tensor,
               state: list[dict], span: int = 0) -> torch.Tensor:
        """One token per slot: tokens, slots, lengths (tokens already cached), M-RoPE deltas, all
        [B] on the device -> logits [B, vocab]. span: the torch path's attention span (Step).

        Each residual add is fused with the norm after it (add_rmsnorm: with kernels also the
        form the next GEMVs read, and the GEMV's split-K partial sums added up on the way in,
        kernels/partials.py); the torch path runs the same sequence through the references."""
        x, step = self.step(tokens, slots, lengths, deltas, span)
        n, n_q = self._rows(x, step, state)
        return self.lm_head(n, *n_q)

    def _rows(self, x: torch.Tensor, step: Step, state: list[dict], scratch: list | None = None,
              slots: torch.Tensor | None = None, pending: tuple | None = None) -> tuple[torch.Tensor, list]:
        """The decoder over decode-style rows (step) -> the final norm's output [R, D] and the form
        the head's GEMV reads. With `scratch` (speculative verify: R = B·T rows, T per row of `slots`)
        the GDN layers run verify (GatedDeltaNet.verify) instead of decode; `pending` as verify's."""
        if self.kernels:
            from ..kernels.add_rmsnorm import add_rmsnorm

            pdl = self.kernels.pdl

            def norm(x, h, norm, quant):
                return add_rmsnorm(x, h, norm.weight, norm.eps, quant, pdl=pdl)
        else:
            from ..kernels.reference import add_rmsnorm_ref

            def norm(x, h, norm, quant):
                return add_rmsnorm_ref(x, h, norm.weight, norm.eps)
        partials = self.kernels is not None  # a batch-1 GEMV may hand add_rmsnorm its splits unreduced
        h = None
        for i, (layer, st, (mixer_q, mlp_q)) in enumerate(zip(self.layers, state, self.norm_quant)):
            x, n, *n_q = norm(x, h, layer.input_layernorm, mixer_q)
            if scratch is not None and isinstance(layer.mixer, GatedDeltaNet):
                h = layer.mixer.verify(n, st, step, slots, scratch[i], *n_q,
                                       pending=pending and (pending[0][i], *pending[1:]))
            else:
                h = layer.mixer.decode(n, st, step, *n_q, partials=partials)
            x, n, *n_q = norm(x, h, layer.post_attention_layernorm, mlp_q)
            h = layer.mlp(n, *n_q, partials=partials)
        _, n, *n_q = norm(x, h, self.norm, self.head_quant)
        return n, n_q

    # --- speculative decoding (#55) ----------------------------------------------------------------

    def alloc_scratch(self, rows: int, tokens: int, device) -> list:
        """Per layer, what a verify of `tokens` positions for up to `rows` rows keeps for its commit
        (GatedDeltaNet.alloc_scratch; None for attention layers, whose rollback is an index)."""
        return [layer.mixer.alloc_scratch(rows, tokens, device, self.dtype)
                if isinstance(layer.mixer, GatedDeltaNet) else None for layer in self.layers]

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, deltas: torch.Tensor,
               state: list[dict], scratch: list, span: int = 0,
               pending: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Score T tokens per row in one pass: tokens [B, T] (the last accepted token, then the
        drafts) at positions lengths[b] … lengths[b]+T-1 of slot slots[b]. Attention treats each
        (row, position) as its own decode row on the row's slot (all T keys written, each query
        seeing its slot's cache up to its own position); Linears and MLPs run the B·T rows at once;
        GDN layers run their verify, keeping in `scratch` (alloc_scratch) what commit needs.
        Returns the logits [B, T, vocab] and the final norm's output [B, T, D] (what the MTP reads).
        Until commit the slots' KV caches hold all T tokens, their GDN states are the verify's business.
        pending (kernels): (the scratch list of a step not yet committed, each row's row in it
        (int32 [B], -1: none), that step's accepted lengths): committed first, inside the verify."""
        bsz, T = tokens.shape
        ahead = torch.arange(T, device=tokens.device)

        def rows(t):  # each row's value T times, materialized (the kernels read contiguous int tensors)
            return t.repeat_interleave(T)

        x, step = self.step(tokens.reshape(-1), rows(slots), (lengths[:, None] + ahead).reshape(-1), rows(deltas), span)
        n, n_q = self._rows(x, step, state, scratch, slots, pending)
        return self.lm_head(n, *n_q).unflatten(0, (bsz, T)), n.unflatten(0, (bsz, T))

    @torch.no_grad()
    def commit(self, state: list[dict], scratch: list, slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """After verify: each row's GDN states as if only its first accepted[b] tokens had run
        (GatedDeltaNet.commit). The KV caches need nothing: entries past a row's length are
        rewritten before any query reads them."""
        for layer, st, sc in zip(self.layers, state, scratch):
            if sc is not None:
                layer.mixer.commit(st, sc, slots, accepted)
