"""The model runner: a model (models/qwen3_5.py) over per-slot state buffers, and the decode
step. Entry points: `encode` requests into prompts (vision tower), `prefill_chunks` (a pass over
chunks of several prompts, each into its slot, continuing where the last chunk stopped) or
`prefill` one request whole, `decode` one token for a batch of slots (tensors), `decode_step` (host lists in, logits out), which on a GPU with the triton backend
replays a CUDA graph captured per batch bucket, and `greedy_step` (what the engine calls): the
same step with its argmax, whose tokens can feed the next step on the device so that the host
reads a step's tokens while the GPU runs the next one. With RuntimeConfig.spec = k (#55), the
checkpoint's MTP layer drafts k tokens per row and `spec_step` (what the engine calls then)
verifies, commits and drafts again; prefill passes fill the MTP's cache behind them.

One slot more than max_slots is allocated: the sentinel, where the padded rows of a bucket
write their (ignored) KV entries and GDN state."""

from __future__ import annotations

import torch

from ..errors import OcriaError
from .config import RuntimeConfig
from .load import open_checkpoint
from .layers import Chunk
from .models.qwen3_5 import Prompt, Qwen3_5

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
        self._spec_graphs: dict[tuple[int, int], tuple] = {}  # speculative steps' graphs (k drafts), by (bucket, parity)
        self._pool = None
        self._last: tuple | None = None  # greedy_step's last launch (rows, its device meta): the next may chain
        self._flip = 0  # which of a bucket's two pinned token buffers the next greedy_step copies into
        self.spec = config.spec
        self.mtp = None
        self._pending: tuple[int, int, list] | None = None  # a deferred GDN commit: (T, parity, its rows' slots)
        self._last_spec: tuple | None = None  # a step the next may chain from: (rows, bucket or None, its next inputs)
        if self.spec:
            self._init_spec(store, kinds)

    @property
    def backend(self) -> str:
        return self.config.backend

    @property
    def tiles(self):
        """The GEMV tile table the triton backend launches with (None: the torch backend)."""
        return None if self.kernels is None else self.kernels.tiles

    def encode(self, encs: list[dict]) -> list[Prompt]:
        """Processed requests (processor outputs, batch of 1 each) -> prompts ready for prefill
        (the vision tower runs here, once for all of them)."""
        for enc in encs:
            n = enc["input_ids"].shape[-1]
            if n > self.max_len:
                raise OcriaError(f"a request of {n} prompt tokens does not fit the runtime's max_len {self.max_len}; "
                                 "raise max_len")
        return self.model.encode(encs)

    def prefill_chunks(self, parts: list[tuple[Prompt, Chunk]], draft: bool = True) -> torch.Tensor:
        """One prefill pass: each (prompt, Chunk(slot, start, n)) advances that prompt's prefill
        in its slot by n tokens; chunks of one prompt must come in order, the first at 0.
        Returns the logits of each chunk's last position [chunks, vocab]. draft: with speculative
        decoding, the MTP fills its cache behind the pass (False: plain decoding follows)."""
        self._last_spec = None
        if self._pending is not None:  # a slot prefilled from its start has nothing left to commit
            fresh = {c.slot for _, c in parts if c.start == 0}
            T, parity, slots = self._pending
            self._pending = (T, parity, [None if s in fresh else s for s in slots])
        if self.mtp is not None and draft:  # speculative decoding: the same pass, then the MTP over its rows
            return self._prefill_and_draft(parts)
        return self.model.prefill(parts, self.state)

    def prefill(self, enc: dict, slot: int) -> tuple[torch.Tensor, int]:
        """One processed request (processor output, batch of 1) into `slot`, whole. Returns the
        logits of its last position and the M-RoPE delta its decode positions are offset by."""
        prompt, = self.encode([enc])
        return self.prefill_chunks([(prompt, Chunk(slot, 0, prompt.length))])[0], prompt.delta

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
               deltas: torch.Tensor) -> torch.Tensor:
        """One token per slot: tokens, slots, lengths (tokens already cached), M-RoPE deltas, all
        [B] on the device. Returns logits [B, vocab]. Runs eagerly."""
        self.flush()
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
        self.flush()
        bucket = bucket_for(n)
        if not self.use_graphs or bucket is None:
            meta = torch.tensor([tokens, slots, lengths, deltas], dtype=torch.long).to(self.device)
            return self.decode(*meta)
        graph, meta, out, _, _ = self._graph(bucket)
        self._write_meta(meta, bucket, tokens, slots, lengths, deltas)
        graph.replay()
        self._last = None  # the graph advanced meta, but nobody holds this step's tokens
        return out[:n]

    def _write_meta(self, meta, bucket, tokens, slots, lengths, deltas, before=None) -> None:
        pad = bucket - len(tokens)
        rows = [tokens + [0] * pad, slots + [self.sentinel] * pad, lengths + [0] * pad, deltas + [0] * pad]
        if before is not None:  # a deferred speculative step's rows in the pending one
            rows.append(before + [-1] * pad)
        host = torch.tensor(rows, dtype=torch.long).pin_memory()
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
        self.flush()
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
        """Capture now the decode graph (and with spec the speculative step's) of every bucket a
        batch of up to `max_batch` rows can use (each compiles its kernels' variants first), so
        that none is captured mid-serving; returns the buckets new here. Nothing to do without
        CUDA graphs."""
        if not self.use_graphs:
            return []
        top = bucket_for(max_batch) or BUCKETS[-1]
        new = [b for b in BUCKETS if b <= top and (b not in self._graphs or self.spec and b <= self.spec_rows and
                                                   (b, 1) not in self._spec_graphs)]
        for b in new:
            self._graph(b)
            if self.spec and b <= self.spec_rows:
                self.flush()
                self._spec_graph(b)
        return new

    def _graph(self, bucket: int):
        """Capture (once) the decode step for `bucket` rows. Warm-up and capture run with every
        row on the sentinel slot, so they touch no real sequence's state."""
        if bucket not in self._graphs:
            meta = torch.zeros(4, bucket, dtype=torch.long, device=self.device)
            meta[1] = self.sentinel

            def body():
                out = self.decode(*meta)
                return out, self._advance(meta, out)

            graph, (out, nxt) = self._capture(body)
            # two pinned buffers the tokens go back to the host through: at most two steps are in flight
            host = [torch.empty(bucket, dtype=torch.long).pin_memory() for _ in range(2)]
            self._graphs[bucket] = (graph, meta, out, nxt, host)
        return self._graphs[bucket]

    def _capture(self, body):
        """body() run twice on a side stream (its kernels compiled, their workspaces allocated outside
        any graph), then captured into a graph of the runners' one memory pool (no two of its graphs
        replay at once). Returns the graph and what the captured body returned."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = body()
        self._pool = graph.pool()
        return graph, out

    def _advance(self, meta: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of a step, also written into `meta` as the next step's input: each row's
        token, its length one more (not the padding rows', which stay at 0 on the sentinel slot).
        A step whose host writes `meta` first overwrites all of it."""
        if self.kernels:  # the argmax and the meta update in one launch
            from .kernels.greedy_advance import greedy_advance

            return greedy_advance(logits, meta[0], meta[1], meta[2], self.sentinel, pdl=self.kernels.pdl)
        from .kernels.reference import greedy_advance_ref

        return greedy_advance_ref(logits, meta[0], meta[1], meta[2], self.sentinel)


    # --- speculative decoding (#55) ---------------------------------------------------------------
    #
    # Per slot, beside the model's state: the MTP layer's KV cache (mtp_state) and the k drafts the
    # next verify checks (drafts). A step (spec_step): verify [last token, d1 … dk] at positions
    # L … L+k (Qwen3_5.verify), accept while draft == the target's argmax (n drafts, plus the
    # target's own next token), commit (GDN states rolled back to L+n+1 tokens from the verify's
    # scratch; KV entries past it are rewritten before any query reads them), then draft the next
    # k: the MTP over the T verified positions (next token = the target's argmax there, hidden =
    # the target's), its output at L+n giving d1, chained k-1 steps on its own output. All of it
    # stays on the device; the tokens come back through one copy at the end.
    #
    # With kernels the GDN commit is deferred: a step leaves it pending, and the next verify does
    # it on its way through the state (kernels/gdn_verify's fused design: the state read and written
    # once a step, 3.38x fla-core + glue at B 32, k 4 against replay's 2.90x). Two scratches per T
    # alternate (parity): one pending, one being filled; a graph per (bucket, parity). flush()
    # commits what is pending wherever a slot's GDN state is read otherwise.

    def _init_spec(self, store, kinds: dict[str, str]) -> None:
        from .models.mtp import MTP, draft_head, has_mtp

        if not has_mtp(store):
            raise OcriaError(f"{store.model_dir}: speculative decoding (--spec {self.spec}) drafts with the "
                             "checkpoint's MTP layer, and this checkpoint has no MTP layer (no mtp.* tensors); run "
                             "without --spec, or use a checkpoint that carries one")
        self.mtp = MTP(self.hf_config, store, kinds, self.dtype, self.kernels, self.config.draft).to(self.device).eval()
        self.mtp_state = self.mtp.alloc_state(self.max_slots + 1, self.max_len, self.device, self.dtype)
        self.drafts = torch.zeros(self.max_slots + 1, self.spec, dtype=torch.long, device=self.device)
        eos = self.hf_config.text_config.eos_token_id
        keep = tuple(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        self.draft_head, self.draft_ids = draft_head(self.model.lm_head, self.config.draft,
                                                     self.config.draft_vocab, keep, self.kernels)
        self.spec_rows = max(self.max_slots, bucket_for(self.max_slots) or 0)  # rows a scratch holds
        self._simulated: torch.Tensor | None = None  # simulate_acceptance's cumulative probabilities
        self.deferred = self.kernels is not None  # GDN commits ride on the next verify (see above)
        self._scratches: dict[tuple[int, int], list] = {}
        self._accepted = torch.ones(2, self.spec_rows, dtype=torch.int32, device=self.device)  # by parity: n + 1
        for parity in ((0, 1) if self.deferred else (0,)):
            self._scratch(self.spec + 1, parity)

    def _scratch(self, tokens: int, parity: int = 0) -> list:
        """The verify scratch of every layer for `tokens` positions (k + 1; fewer only where a row
        nears max_len) and a parity (deferred commits alternate two), allocated once."""
        if (tokens, parity) not in self._scratches:
            self._scratches[tokens, parity] = self.model.alloc_scratch(self.spec_rows, tokens, self.device)
        return self._scratches[tokens, parity]

    def flush(self) -> None:
        """Commit the GDN state a speculative step left pending (deferred: the next verify would), for
        whatever reads the slots' GDN state otherwise: a plain decode step, a graph's warm-up."""
        self._last_spec = None  # what a chained step would continue is being changed
        if self._pending is None:
            return
        T, parity, slots = self._pending
        self._pending = None
        sl = torch.tensor([-1 if s is None else s for s in slots], dtype=torch.long, device=self.device)
        self.model.commit(self.state, self._scratch(T, parity), sl, self._accepted[parity, :len(slots)])

    def _pending_rows(self, slots: list[int]) -> tuple[int, list[int] | None]:
        """This step's parity and, deferred, each row's row in the pending step (-1: nothing pending)."""
        if not self.deferred:
            return 0, None
        if self._pending is None:
            return 0, [-1] * len(slots)
        _, parity, before = self._pending
        where = {s: j for j, s in enumerate(before) if s is not None}
        return 1 - parity, [where.get(s, -1) for s in slots]

    def simulate_acceptance(self, probs: list[float] | None) -> None:
        """For benchmarks on random weights only (bench --acceptance on a named shape), whose drafts the
        target never accepts: each row of a step accepts a number of drafts drawn on the device from
        `probs` (P(a step gives 1 … k+1 tokens)) instead of where draft and target agree. The step's
        costs stay real (verify, commit at that length, drafting); its tokens mean nothing. Set it
        before any speculative graph is captured (they are captured with or without it); None: off."""
        if self._spec_graphs:
            raise OcriaError("simulate_acceptance: set it before the speculative graphs are captured")
        if probs is not None and len(probs) != self.spec + 1:
            raise ValueError(f"simulate_acceptance: {self.spec + 1} probabilities (1 … k+1 tokens), got {len(probs)}")
        self._simulated = None if probs is None else \
            torch.tensor(probs, dtype=torch.float32, device=self.device).cumsum(0)

    def _draft_token(self, h: torch.Tensor) -> torch.Tensor:
        best = self.draft_head(h).argmax(-1)
        return best if self.draft_ids is None else self.draft_ids[best]

    def _chain(self, h: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, deltas: torch.Tensor,
               span: int) -> torch.Tensor:
        """Drafts for rows whose target holds `lengths` tokens, from the MTP's output h [B, D] at
        position lengths-1: d1 from h, then k-1 MTP steps on its own output, step j at position
        lengths+j-2 (clamped below max_len: a draft from past it is never verified). Writes and
        returns drafts [B, k]."""
        drafts = [self._draft_token(h)]
        for j in range(2, self.spec + 1):
            pos = (lengths + j - 2).clamp(max=self.max_len - 1)
            e, step = self.model.step(drafts[-1], slots, pos, deltas, span)
            h = self.mtp.decode(e, h, self.mtp_state, step)
            drafts.append(self._draft_token(h))
        out = torch.stack(drafts, 1)
        self.drafts[slots] = out
        return out

    @torch.no_grad()
    def _prefill_and_draft(self, parts: list[tuple[Prompt, Chunk]]) -> torch.Tensor:
        """prefill_chunks with speculative decoding: the target's pass (its logits exactly as
        Qwen3_5.prefill gives them), then the MTP over the same rows into its own cache, each
        position's next token being the prompt's next (its embedding as the target sees it: image
        features in place) or, at a prompt's last position, the first generated token (the argmax
        of its logits, what the engine takes). A prompt that ends here gets its first k drafts."""
        model = self.model
        x = model.prefill_hidden(parts, self.state)
        last = torch.tensor([c.n for _, c in parts], device=x.device).cumsum(0) - 1
        logits = model.lm_head(model.norm(x[last]))
        hidden = model.norm(x)
        firsts = logits.argmax(-1)
        nxt, ends = [], []
        for i, (prompt, c) in enumerate(parts):
            end = c.start + c.n
            if end < prompt.length:
                nxt.append(prompt.embeds[c.start + 1:end + 1])
            else:
                nxt.append(torch.cat([prompt.embeds[c.start + 1:end], model.embed(firsts[i:i + 1])]))
                ends.append(i)
        cos, sin = model.rope(torch.cat([p.positions[:, c.start:c.start + c.n] for p, c in parts], dim=1))
        h = self.mtp.prefill(torch.cat(nxt), hidden, self.mtp_state, [c for _, c in parts], cos, sin)
        if ends:
            meta = torch.tensor([[parts[i][1].slot for i in ends], [parts[i][0].length for i in ends],
                                 [parts[i][0].delta for i in ends]], dtype=torch.long).to(self.device)
            span = 0 if self.kernels else min(self.max_len, max(parts[i][0].length for i in ends) + self.spec)
            self._chain(h[last[ends]], meta[0], meta[1], meta[2], span)
        return logits

    @torch.no_grad()
    def spec_step(self, tokens: list[int] | None, slots: list[int], lengths: list[int], deltas: list[int],
                  clock=None) -> "PendingSpec":
        """One speculative step for decode rows (host lists, as greedy_step's): verify each row's
        last token and its k drafts, accept the longest prefix of drafts the target agrees with,
        commit, draft the next k. Returns a handle whose get() gives each row's new tokens (1 to
        k+1: the accepted drafts and the target's token after them), exactly those greedy decoding
        gives. With CUDA graphs the batch is padded to its bucket and the (bucket, k) graph
        replayed; rows near max_len verify fewer drafts, eagerly. clock(name): called after each
        phase (bench times them; it synchronizes, so the step runs eagerly).

        tokens None chains: the same rows as the last step (one of k+1 positions, handle.chainable),
        each fed that step's last token at its new length, both on the device: nothing goes there
        from the host, so the caller can launch this step before it reads the last one's tokens.
        `lengths` are then the rows' lengths before the last step, for the max_len check."""
        if self.mtp is None:
            raise OcriaError("spec_step needs a runner built with spec > 0 (RuntimeConfig.spec)")
        if tokens is None:
            return self._chained_spec_step(slots, lengths)
        top = max(lengths)
        if top >= self.max_len:
            raise OcriaError(f"a sequence reached the runtime's max_len {self.max_len}; raise max_len")
        T = min(self.spec, self.max_len - 1 - top) + 1
        bsz = len(slots)
        if bsz > self.spec_rows:
            raise OcriaError(f"{bsz} speculative rows, but the runner holds {self.spec_rows}")
        if self._pending is not None and self._pending[0] != T:  # the fused verify continues a step of its T
            self.flush()
        bucket = bucket_for(bsz)
        graphed = self.use_graphs and clock is None and T == self.spec + 1 and bucket is not None
        if graphed and (bucket, 1) not in self._spec_graphs:
            self.flush()  # a capture's warm-up writes the scratches and accepted lengths of both parities
            self._spec_graph(bucket)
        parity, before = self._pending_rows(slots)
        chainable = T == self.spec + 1 and clock is None
        if graphed:
            self._write_meta(self._spec_graphs[bucket, parity][1], bucket, tokens, slots, lengths, deltas, before)
            out = self._replay_spec(bucket, parity, bsz)
            self._last_spec = (bsz, bucket, None)
        else:
            meta = torch.tensor([tokens, slots, lengths, deltas] + ([before] if self.deferred else []),
                                dtype=torch.long).to(self.device)
            nxt = torch.empty_like(meta) if chainable else None
            out = PendingSpec(*self._spec_body(*meta[:4], T, self._spans(top, T), clock, parity,
                                               meta[4] if self.deferred else None, nxt), chainable)
            self._last_spec = (bsz, None, nxt) if chainable else None
        if self.deferred:
            self._pending = (T, parity, list(slots))
        return out

    def _chained_spec_step(self, slots: list[int], lengths: list[int]) -> "PendingSpec":
        """spec_step(None, ...): the last step's rows again, from the inputs it left on the device."""
        bsz, T = len(slots), self.spec + 1
        if self._last_spec is None or self._last_spec[0] != bsz:
            raise OcriaError("spec_step(None, ...) chains from a last speculative step of the same rows; there is none")
        if max(lengths) + 2 * T >= self.max_len:  # the rows may have grown by up to T since `lengths`
            raise OcriaError(f"a chained speculative step could pass max_len {self.max_len}; run it from the host")
        _, bucket, nxt = self._last_spec
        parity = 1 - self._pending[1] if self.deferred else 0
        if bucket is not None:  # the last graph wrote this graph's inputs
            out = self._replay_spec(bucket, parity, bsz)
        else:
            after = torch.empty_like(nxt)  # spans from max(lengths) + T: at most where the rows are now
            out = PendingSpec(*self._spec_body(*nxt[:4], T, self._spans(max(lengths) + T, T), None, parity,
                                               nxt[4] if self.deferred else None, after), True)
            self._last_spec = (bsz, None, after)
        if self.deferred:
            self._pending = (T, parity, list(slots))
        return out

    def _replay_spec(self, bucket: int, parity: int, bsz: int) -> "PendingSpec":
        graph, _, target, n = self._spec_graphs[bucket, parity]
        graph.replay()
        return PendingSpec(target[:bsz].clone(), n[:bsz].clone(), True)  # the next replay overwrites the graph's

    def _spans(self, top: int, T: int) -> tuple[int, int]:
        """The torch path's attention spans for a verify of T positions from rows of at most `top` tokens
        and for its drafting (0 with kernels, whose attention reads each row's own length)."""
        return (0, 0) if self.kernels else (top + T, min(self.max_len, top + T + self.spec))

    def _spec_body(self, tok: torch.Tensor, sl: torch.Tensor, ln: torch.Tensor, dl: torch.Tensor, T: int,
                   spans: tuple[int, int], clock=None, parity: int = 0, before: torch.Tensor | None = None,
                   nxt: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """spec_step on the device (what its graph holds): rows' last tokens, slots, lengths, deltas [B];
        T positions verified; spans: the torch path's attention spans for the verify and the drafting
        (0 with kernels); deferred (`before`: each row's row in the pending step, -1 none), the
        pending step is committed inside this verify and this one's left pending, in scratch
        `parity`; nxt [4 or 5, B]: where the next step's inputs go, for a chained call (padding
        rows, on the sentinel slot, stay at length 0). Returns the target's argmax [B, T] and the
        drafts accepted per row [B]."""
        bsz = tok.shape[0]
        inp = torch.cat([tok[:, None], self.drafts[sl, :T - 1]], 1)                      # [B, T]
        scratch = self._scratch(T, parity)
        pending = None if before is None else (self._scratch(T, 1 - parity), before.to(torch.int32),
                                               self._accepted[1 - parity])
        logits, hidden = self.model.verify(inp, sl, ln, dl, self.state, scratch, spans[0], pending)
        target = logits.argmax(-1)                                                        # [B, T]
        n = (inp[:, 1:] == target[:, :-1]).long().cumprod(1).sum(1)                       # drafts accepted
        if self._simulated is not None:  # bench on random weights: the accepted count drawn (simulate_acceptance)
            u = torch.rand(bsz, device=tok.device) * self._simulated[-1]
            n = torch.searchsorted(self._simulated, u, right=True).clamp(max=T - 1)
        if clock:
            clock("verify")
        if before is None:
            self.model.commit(self.state, scratch, sl, n + 1)  # gdn_commit's call site (flush's too)
        else:
            self._accepted[parity, :bsz] = (n + 1).to(torch.int32)  # committed by the next verify, or flush
        if clock:
            clock("commit")
        # The MTP over all T verified positions (fixed shape): rows past a row's n write KV entries at
        # positions the chain or the next step rewrites before any query reads them.
        ahead = torch.arange(T, device=tok.device)
        e, step = self.model.step(target.reshape(-1), sl.repeat_interleave(T), (ln[:, None] + ahead).reshape(-1),
                                  dl.repeat_interleave(T), spans[0])
        h = self.mtp.decode(e, hidden.reshape(bsz * T, -1), self.mtp_state, step).unflatten(0, (bsz, T))
        rows = torch.arange(bsz, device=tok.device)
        self._chain(h[rows, n], sl, ln + n + 1, dl, spans[1])
        if nxt is not None:  # the same rows next, each fed its last token (the target's own) past what it accepted
            pad = sl == self.sentinel
            nxt[0], nxt[1], nxt[3] = target[rows, n], sl, dl
            nxt[2] = torch.where(pad, 0, ln + n + 1)
            if before is not None:
                nxt[4] = torch.where(pad, -1, rows)
        if clock:
            clock("draft")
        return target, n

    def _spec_graph(self, bucket: int) -> None:
        """Capture (once) the speculative step for `bucket` rows and k drafts, one graph per parity
        (graphs run the kernels, whose commits are deferred), as _graph does the decode step: warm-up
        and capture with every row on the sentinel slot and nothing pending; one memory pool with the
        decode graphs (no two replay at once). Nothing may be pending (flush): the warm-up writes both
        parities' scratches."""
        metas = []
        for _ in range(2):  # a graph writes the next step's inputs into the other parity's (chaining)
            meta = torch.zeros(5, bucket, dtype=torch.long, device=self.device)
            meta[1], meta[4] = self.sentinel, -1
            metas.append(meta)
        for parity, meta in enumerate(metas):
            graph, (target, n) = self._capture(lambda meta=meta, parity=parity: self._spec_body(
                *meta[:4], self.spec + 1, (0, 0), None, parity, meta[4], metas[1 - parity]))
            self._spec_graphs[bucket, parity] = (graph, meta, target, n)


class PendingSpec:
    """A speculative step's tokens: get() returns each row's accepted tokens as lists. chainable:
    the next step may be launched from the device (spec_step(None, ...)) before get()."""

    def __init__(self, target: torch.Tensor, n: torch.Tensor, chainable: bool = False):
        self._target, self._n, self.chainable = target, n, chainable

    def get(self) -> list[list[int]]:
        target, n = self._target.tolist(), self._n.tolist()
        return [row[:k + 1] for row, k in zip(target, n)]


class PendingTokens:
    """A launched greedy step's tokens: get() waits for the step (when it ran on a GPU) and
    returns them as a list."""

    def __init__(self, tokens: torch.Tensor, done, n: int):
        self._tokens, self._done, self._n = tokens, done, n

    def get(self) -> list[int]:
        if self._done is not None:
            self._done.synchronize()
        return self._tokens[:self._n].tolist()
