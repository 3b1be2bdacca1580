"""The model runner: our Qwen3.5 text decoder over per-slot state buffers, plus transformers'
vision tower in BF16. Entry points: `prefill` one request into a slot, `decode` one token for
a batch of slots (tensors), `decode_step` (host lists in, logits out), which on a GPU with the
triton backend replays a CUDA graph captured per batch bucket, and `greedy_step` (what the
engine calls): the same step with its argmax, whose tokens can feed the next step on the device
so that the host reads a step's tokens while the GPU runs the next one.

One slot more than max_slots is allocated: the sentinel, where the padded rows of a bucket
write their (ignored) KV entries and GDN state."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import OcriaError
from .layers import MLP, Attention, GatedDeltaNet, RMSNorm, Step
from .load import TEXT, open_checkpoint, read_linear

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # CUDA-graph batch sizes; the GEMVs take M <= 64


def bucket_for(n: int) -> int | None:
    """The smallest CUDA-graph bucket that holds n rows; None above the largest (run eagerly)."""
    return next((b for b in BUCKETS if b >= n), None)


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


class RuntimeModel(nn.Module):
    """Every tensor is held in `dtype` (BF16 by default), as transformers holds a model loaded
    with that dtype — Qwen3.5 keeps no module in fp32 — except the quantized weights' packed
    forms and the fp32 GDN recurrent state."""

    def __init__(self, path, device: str = "cpu", max_slots: int = 8, max_len: int = 2048,
                 dtype: torch.dtype = torch.bfloat16, backend: str = "torch", cuda_graphs: bool = True,
                 source: tuple | None = None):
        """`source` = (config, TensorStore-like, kinds) builds from tensors in memory instead of
        `path` (ocriaquant bench's random-weight shapes)."""
        super().__init__()
        from transformers import Qwen3_5Config
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding, Qwen3_5VisionModel

        from ..model.route_kernels import route_by_device

        route_by_device()  # the torch backend on the CPU calls transformers' GDN functions (layers.py)
        if source is None:
            model_dir, _, store, kinds = open_checkpoint(path)
            self.config = Qwen3_5Config.from_pretrained(model_dir)
        else:
            self.config, store, kinds = source
            model_dir = store.model_dir
        tc = self.config.text_config
        self.dtype, self.max_slots, self.max_len = dtype, max_slots, max_len

        def lin(name):
            return read_linear(store, name, kinds.get(name), dtype)

        layers = []
        for i, kind in enumerate(tc.layer_types):
            pre = f"{TEXT}layers.{i}."
            if kind == "linear_attention":
                a = pre + "linear_attn."
                p = store.require([a + n for n in ("conv1d.weight", "A_log", "dt_bias", "norm.weight")])
                mixer = GatedDeltaNet(tc, {k[len(a):]: v.to(dtype) for k, v in p.items()},
                                      {n: lin(a + n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b",
                                                               "out_proj")})
            elif kind == "full_attention":
                a = pre + "self_attn."
                p = store.require([a + "q_norm.weight", a + "k_norm.weight"])
                mixer = Attention(tc, {k[len(a):]: v.to(dtype) for k, v in p.items()},
                                  {n: lin(a + n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
            else:
                raise OcriaError(f"{model_dir}: layer {i} has type {kind!r}; Qwen3.5 has linear_attention and "
                                 "full_attention layers only")
            norms = {k: v.to(dtype) for k, v in store.require([pre + "input_layernorm.weight",
                                                               pre + "post_attention_layernorm.weight"]).items()}
            layer = nn.Module()
            layer.mixer = mixer
            layer.mlp = MLP(*(lin(f"{pre}mlp.{n}") for n in ("gate_proj", "up_proj", "down_proj")))
            layer.input_layernorm = RMSNorm(norms[pre + "input_layernorm.weight"], tc.rms_norm_eps)
            layer.post_attention_layernorm = RMSNorm(norms[pre + "post_attention_layernorm.weight"], tc.rms_norm_eps)
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.embed = nn.Embedding.from_pretrained(store.require([TEXT + "embed_tokens.weight"])[
            TEXT + "embed_tokens.weight"].to(dtype), freeze=True)
        self.norm = RMSNorm(store.require([TEXT + "norm.weight"])[TEXT + "norm.weight"].to(dtype), tc.rms_norm_eps)
        if "lm_head.weight" in store or "lm_head.weight_packed" in store:
            self.lm_head = lin("lm_head")
        else:  # tied embeddings
            from .layers import QuantLinear

            self.lm_head = QuantLinear("bf16", self.embed.weight, dtype=dtype)
        self.rotary = Qwen3_5TextRotaryEmbedding(tc)
        self.visual = Qwen3_5VisionModel._from_config(self.config.vision_config, dtype=dtype)
        vis = {k[len("model.visual."):]: store.get(k) for k in store.where if k.startswith("model.visual.")}
        missing, unexpected = self.visual.load_state_dict(vis, strict=False)
        if missing:
            raise OcriaError(f"{model_dir}: vision tower tensors missing: {', '.join(sorted(missing)[:5])}")
        self.rope_index = _RopeIndex(self.config)
        if backend not in ("torch", "triton"):
            raise OcriaError(f"unknown backend {backend!r}; torch or triton")
        # triton: decode steps run the GDN layers through gdn_decode and FP8 / NVFP4 Linears through
        # the GEMV kernels (MLPs with an FP8 down_proj through silu_mul_quant); prefill stays torch.
        for m in self.modules():
            if hasattr(type(m), "triton"):
                m.triton = backend == "triton"
        if backend == "triton":  # one weight stream per input: qkv(+z, a, b), gate+up
            for layer in self.layers:
                layer.mixer.fuse()
                layer.mlp.fuse()
        # Norms whose Linears all read FP8 or all NVFP4 (W4A16) write their output in the form
        # those GEMVs read as well (add_rmsnorm's quant), saving a launch or a pass per GEMV.
        def quant_for(linears):
            kinds = {q.kind for q in linears}
            return next(iter(kinds)) if backend == "triton" and len(kinds) == 1 and kinds <= {"fp8", "nvfp4"} else None

        self._norm_quant = [(quant_for(layer.mixer.input_linears()), quant_for(layer.mlp.input_linears()))
                            for layer in self.layers]
        self._head_quant = quant_for([self.lm_head])
        self.backend = backend
        self.to(device)
        self.device = torch.device(device)
        if backend == "triton":  # NVFP4 weights in the batch-1 kernel's bit order, made on the device
            self._pack_m1()
            # a decode token's cos / sin by position, gathered by step_inputs (positions stay below max_len:
            # lengths are checked against it, and Qwen3.5's M-RoPE deltas are never positive, see prefill);
            # at decode the three M-RoPE sections share the position
            cos, sin = self._rope(torch.arange(max_len, device=self.device)[None].expand(3, -1))
            self._rope_cos, self._rope_sin = cos.contiguous(), sin.contiguous()
        self.sentinel = max_slots
        self.state = [layer.mixer.alloc_state(max_slots + 1, max_len, self.device, dtype)
                      if isinstance(layer.mixer, Attention) else layer.mixer.alloc_state(max_slots + 1, self.device, dtype)
                      for layer in self.layers]
        self.use_graphs = cuda_graphs and backend == "triton" and self.device.type == "cuda"
        self._graphs: dict[int, tuple] = {}
        self._pool = None
        self._last: tuple | None = None  # greedy_step's last launch (rows, its device meta): the next may chain
        self._flip = 0  # which of a bucket's two pinned token buffers the next greedy_step copies into
        self.eval()

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, N] -> cos, sin [N, rot] in the model dtype, as transformers computes them."""
        dummy = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(dummy, positions[:, None, :])
        return cos[0], sin[0]

    @torch.no_grad()
    def prefill(self, enc: dict, slot: int) -> tuple[torch.Tensor, int]:
        """One processed request (processor output, batch of 1) into `slot`. Returns the logits
        of its last position and the M-RoPE delta its decode positions are offset by."""
        ids = enc["input_ids"][0].to(self.device)
        if ids.numel() > self.max_len:
            raise OcriaError(f"a request of {ids.numel()} prompt tokens does not fit the runtime's max_len "
                             f"{self.max_len}; raise max_len")
        x = self.embed(ids)
        if "pixel_values" in enc:
            grid = enc["image_grid_thw"].to(self.device)
            img = self.visual(enc["pixel_values"].to(self.device, self.dtype), grid_thw=grid,
                              return_dict=True).pooler_output
            mask = ids == self.config.image_token_id
            if int(mask.sum()) != img.shape[0]:
                raise OcriaError(f"{int(mask.sum())} image tokens but {img.shape[0]} image features")
            x = x.clone()
            x[mask] = img.to(x.dtype)
            pos, delta = self.rope_index(ids[None], enc["mm_token_type_ids"].to(self.device), grid)
            pos, delta = pos[:, 0], int(delta.reshape(-1)[0])
            if delta > 0 and self.backend == "triton":  # image positions take at most one per token: delta <= 0
                raise OcriaError(f"an M-RoPE delta of {delta} > 0: decode positions would pass the runtime's "
                                 f"rope tables (max_len {self.max_len}); this is not a Qwen3.5 position layout")
        else:
            pos, delta = torch.arange(ids.numel(), device=self.device)[None].expand(3, -1), 0
        cos, sin = self._rope(pos)
        for layer, st in zip(self.layers, self.state):
            h = layer.input_layernorm(x)
            if isinstance(layer.mixer, Attention):
                h = layer.mixer.prefill(h, st, slot, cos, sin)
            else:
                h = layer.mixer.prefill(h, st, slot)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.norm(x[-1:]))[0], delta

    @torch.no_grad()
    def _pack_m1(self) -> None:
        from .layers import QuantLinear

        for layer in self.layers:
            if isinstance(layer.mlp, MLP) and layer.mlp.fused_silu():
                layer.mlp.gate_up.linear.pack_m1(interleave=True)
        for m in self.modules():
            if isinstance(m, QuantLinear) and m.kind.startswith("nvfp4") and m.w_m1 is None:
                m.pack_m1()

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
               deltas: torch.Tensor) -> torch.Tensor:
        """One token per slot: tokens, slots, lengths (tokens already cached), M-RoPE deltas, all
        [B] on the device. Returns logits [B, vocab]. Runs eagerly."""
        span = 0
        if self.backend == "torch":
            span = int(lengths.max()) + 1  # one host sync a step, shared by every attention layer
            if span > self.max_len:
                raise OcriaError(f"a sequence reached the runtime's max_len {self.max_len}; raise max_len")
        if self.backend == "triton":
            from .kernels import add_rmsnorm, step_inputs

            # one launch for the embedding, cos / sin and the int32 ids
            x, cos, sin, slots32, lengths32 = step_inputs(tokens, slots, lengths, deltas, self.embed.weight,
                                                          self._rope_cos, self._rope_sin)
            step = Step(slots, lengths, cos, sin, slots32, lengths32, span)
            # Each residual add is fused with the norm after it (and the form the next GEMVs read).
            # h may be a batch-1 GEMV's split-K partial sums, which add_rmsnorm adds up (runtime/partials.py):
            # H200, mixed plan, batch 1: 2.24-2.27 -> 2.21 ms a step (BENCHMARKS.md, session 9)
            h = None
            for layer, st, (mixer_q, mlp_q) in zip(self.layers, self.state, self._norm_quant):
                x, n, *n_q = add_rmsnorm(x, h, layer.input_layernorm.weight, layer.input_layernorm.eps, mixer_q)
                h = layer.mixer.decode(n, st, step, *n_q, partials=True)
                x, n, *n_q = add_rmsnorm(x, h, layer.post_attention_layernorm.weight,
                                         layer.post_attention_layernorm.eps, mlp_q)
                h = layer.mlp(n, *n_q, partials=True)
            _, n, *n_q = add_rmsnorm(x, h, self.norm.weight, self.norm.eps, self._head_quant)
            return self.lm_head(n, *n_q)
        cos, sin = self._rope((lengths + deltas)[None].expand(3, -1))
        step = Step(slots, lengths, cos, sin, slots.to(torch.int32), lengths.to(torch.int32), span)
        x = self.embed(tokens)
        for layer, st in zip(self.layers, self.state):
            x = x + layer.mixer.decode(layer.input_layernorm(x), st, step)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def decode_step(self, tokens: list[int], slots: list[int], lengths: list[int], deltas: list[int]) -> torch.Tensor:
        """decode() from host lists with one host-to-device copy; with CUDA graphs, the batch is
        padded to the next bucket (rows on the sentinel slot) and the bucket's graph replayed.
        Returns logits [B, vocab] (a view of the graph's output: read it before the next step)."""
        n = len(tokens)
        if lengths and max(lengths) >= self.max_len:
            raise OcriaError(f"a sequence reached the runtime's max_len {self.max_len}; raise max_len")
        bucket = bucket_for(n)
        if not self.use_graphs or bucket is None:
            meta = torch.tensor([tokens, slots, lengths, deltas], dtype=torch.long).to(self.device)
            return self.decode(*meta)
        graph, meta, out, _, _ = self._graph(bucket)
        self._write_meta(meta, bucket, tokens, slots, lengths, deltas)
        graph.replay()
        self._last = None  # the graph advanced meta, but nobody holds this step's tokens
        return out[:n]

    def _write_meta(self, meta, bucket, tokens, slots, lengths, deltas) -> None:
        pad = bucket - len(tokens)
        host = torch.tensor([tokens + [0] * pad, slots + [self.sentinel] * pad, lengths + [0] * pad,
                             deltas + [0] * pad], dtype=torch.long).pin_memory()
        meta.copy_(host, non_blocking=True)

    @torch.no_grad()
    def greedy_step(self, tokens: list[int] | None, slots: list[int], lengths: list[int],
                    deltas: list[int]) -> "PendingTokens":
        """One decode step and its argmax, launched; the tokens come back through the returned
        handle's get() (which waits for them). tokens None chains: the same rows as the last call,
        each fed the token that call produced, its length one more — nothing goes to the device,
        so the caller can launch step t+1 before it reads step t's tokens (the engine does, and
        the host's work hides behind the GPU's). `lengths` are then those of this step (the last
        call's plus one): they are checked against max_len and must match what the device holds."""
        n = len(slots)
        if lengths and max(lengths) >= self.max_len:
            raise OcriaError(f"a sequence reached the runtime's max_len {self.max_len}; raise max_len")
        if tokens is None and (self._last is None or self._last[0] != n):
            raise OcriaError("greedy_step(None, ...) chains from a last step of the same rows; there is none")
        bucket = bucket_for(n)
        if not self.use_graphs or bucket is None:
            if tokens is None:
                meta = self._last[1]
            else:
                meta = torch.tensor([tokens, slots, lengths, deltas], dtype=torch.long).to(self.device)
            nxt = self._advance(meta, self.decode(*meta.clone()))
            self._last = (n, meta)
            return PendingTokens(nxt.clone(), None, n)
        graph, meta, _, nxt, host = self._graph(bucket)
        if tokens is not None:
            self._write_meta(meta, bucket, tokens, slots, lengths, deltas)
        graph.replay()
        # back to the host without a sync: the copy follows the step on the stream, and the next
        # replay (which overwrites nxt) follows the copy; buffers alternate, two steps being in flight
        self._flip ^= 1
        buf = host[self._flip]
        buf.copy_(nxt, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._last = (n, meta)
        return PendingTokens(buf, done, n)

    def capture_buckets(self, max_batch: int) -> list[int]:
        """Capture now the decode graph of every bucket a batch of up to `max_batch` rows can
        use (each compiles its kernels' variants first), so that none is captured mid-serving;
        returns the buckets captured here. Nothing to do without CUDA graphs."""
        if not self.use_graphs:
            return []
        top = bucket_for(max_batch) or BUCKETS[-1]
        new = [b for b in BUCKETS if b <= top and b not in self._graphs]
        for b in new:
            self._graph(b)
        return new

    def _graph(self, bucket: int):
        """Capture (once) the decode step for `bucket` rows. Warm-up and capture run with every
        row on the sentinel slot, so they touch no real sequence's state."""
        if bucket not in self._graphs:
            meta = torch.zeros(4, bucket, dtype=torch.long, device=self.device)
            meta[1] = self.sentinel
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # compile the kernels and allocate their workspaces outside the graph
                for _ in range(2):
                    self.decode(*meta)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.decode(*meta)
                nxt = self._advance(meta, out)
            self._pool = graph.pool()  # one memory pool for all buckets: they never replay at once
            # two pinned buffers the tokens go back to the host through: at most two steps are in flight
            host = [torch.empty(bucket, dtype=torch.long).pin_memory() for _ in range(2)]
            self._graphs[bucket] = (graph, meta, out, nxt, host)
        return self._graphs[bucket]

    def _advance(self, meta: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of a step, also written into `meta` as the next step's input: each row's
        token, its length one more (not the padding rows', which stay at 0 on the sentinel slot).
        A step whose host writes `meta` first overwrites all of it."""
        if self.backend == "triton":  # the argmax and the meta update in one launch
            from .kernels import greedy_advance

            return greedy_advance(logits, meta[0], meta[1], meta[2], self.sentinel)
        nxt = logits.argmax(-1)
        meta[0].copy_(nxt)
        meta[2].add_(meta[1] != self.sentinel)
        return nxt


class PendingTokens:
    """A launched greedy step's tokens: get() waits for the step (when it ran on a GPU) and
    returns them as a list."""

    def __init__(self, tokens: torch.Tensor, done, n: int):
        self._tokens, self._done, self._n = tokens, done, n

    def get(self) -> list[int]:
        if self._done is not None:
            self._done.synchronize()
        return self._tokens[:self._n].tolist()
