"""The model runner: a model (models/qwen3_5.py) over per-slot state buffers, and the decode
step. Entry points: `prefill` one request into a slot, `decode` one token for a batch of slots
(tensors), `decode_step` (host lists in, logits out), which on a GPU with the triton backend
replays a CUDA graph captured per batch bucket, and `greedy_step` (what the engine calls): the
same step with its argmax, whose tokens can feed the next step on the device so that the host
reads a step's tokens while the GPU runs the next one.

One slot more than max_slots is allocated: the sentinel, where the padded rows of a bucket
write their (ignored) KV entries and GDN state."""

from __future__ import annotations

import torch

from ..errors import OcriaError
from .config import RuntimeConfig
from .load import open_checkpoint
from .models.qwen3_5 import Qwen3_5

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # CUDA-graph batch sizes; the GEMVs take M <= 64


def bucket_for(n: int) -> int | None:
    """The smallest CUDA-graph bucket that holds n rows; None above the largest (run eagerly)."""
    return next((b for b in BUCKETS if b >= n), None)


class ModelRunner:
    """Built once from a checkpoint directory (None: the bundled model) and a RuntimeConfig, or
    from tensors in memory: source = (transformers Qwen3_5Config, a TensorStore such as
    load.MemoryStore, module name -> format) (bench's random-weight shapes)."""

    def __init__(self, checkpoint=None, config: RuntimeConfig | None = None, *, source: tuple | None = None):
        from transformers import Qwen3_5Config

        self.config = config = config or RuntimeConfig()
        if source is None:
            model_dir, _, store, kinds = open_checkpoint(checkpoint)
            hf_config = Qwen3_5Config.from_pretrained(model_dir)
        else:
            hf_config, store, kinds = source
        self.hf_config = hf_config
        self.device, self.dtype = config.device, config.dtype
        self.max_slots, self.max_len = config.max_slots, config.max_len
        self.kernels = config.kernel_settings()  # None: the torch backend
        self.model = Qwen3_5(hf_config, store, kinds, self.dtype, self.kernels).to(self.device).eval()
        if self.kernels:
            self.model.prepare_kernels(self.max_len)
        self.sentinel = self.max_slots
        self.state = self.model.alloc_state(self.max_slots + 1, self.max_len, self.device)
        self.use_graphs = config.cuda_graphs and self.kernels is not None and self.device.type == "cuda"
        self._graphs: dict[int, tuple] = {}
        self._pool = None
        self._last: tuple | None = None  # greedy_step's last launch (rows, its device meta): the next may chain
        self._flip = 0  # which of a bucket's two pinned token buffers the next greedy_step copies into

    @property
    def backend(self) -> str:
        return self.config.backend

    @property
    def tiles(self):
        """The GEMV tile table the triton backend launches with (None: the torch backend)."""
        return None if self.kernels is None else self.kernels.tiles

    def prefill(self, enc: dict, slot: int) -> tuple[torch.Tensor, int]:
        """One processed request (processor output, batch of 1) into `slot`. Returns the logits
        of its last position and the M-RoPE delta its decode positions are offset by."""
        n = enc["input_ids"].shape[-1]
        if n > self.max_len:
            raise OcriaError(f"a request of {n} prompt tokens does not fit the runtime's max_len {self.max_len}; "
                             "raise max_len")
        return self.model.prefill(enc, self.state, slot)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
               deltas: torch.Tensor) -> torch.Tensor:
        """One token per slot: tokens, slots, lengths (tokens already cached), M-RoPE deltas, all
        [B] on the device. Returns logits [B, vocab]. Runs eagerly."""
        span = 0
        if self.kernels is None:
            span = int(lengths.max()) + 1  # one host sync a step, shared by every attention layer
            if span > self.max_len:
                raise OcriaError(f"a sequence reached the runtime's max_len {self.max_len}; raise max_len")
        return self.model.decode(tokens, slots, lengths, deltas, self.state, span)

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
        if self.kernels:  # the argmax and the meta update in one launch
            from .kernels.greedy_advance import greedy_advance

            return greedy_advance(logits, meta[0], meta[1], meta[2], self.sentinel, pdl=self.kernels.pdl)
        from .kernels.reference import greedy_advance_ref

        return greedy_advance_ref(logits, meta[0], meta[1], meta[2], self.sentinel)


class PendingTokens:
    """A launched greedy step's tokens: get() waits for the step (when it ran on a GPU) and
    returns them as a list."""

    def __init__(self, tokens: torch.Tensor, done, n: int):
        self._tokens, self._done, self._n = tokens, done, n

    def get(self) -> list[int]:
        if self._done is not None:
            self._done.synchronize()
        return self._tokens[:self._n].tolist()
