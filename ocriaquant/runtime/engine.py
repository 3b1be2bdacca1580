"""The engine: page requests in, markdown out. Continuous batching with chunked prefill: each
step decodes one token for every running sequence and advances the prefill of admitted ones by
up to `prefill_budget` prompt tokens (several requests' chunks in one pass), so an admission
never stalls the running sequences for a whole page. Requests are pulled from their iterable
only when a slot frees, so a backlog streams through. With speculative decoding (spec = k, #55)
a decode step is the runner's spec_step: up to k+1 tokens a row, cut where greedy would stop."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator

from ..data.page import Page
from ..model.load import resolve_model_dir
from ..model.processor import encode_page, load_processor
from .config import RuntimeConfig
from .model_runner import ModelRunner
from .scheduler import Scheduler, Sequence

PREFILL_BUDGET = 4096  # prompt tokens a step prefills: about one 4.1 MP page (BENCHMARKS.md)
MIN_CHUNK = 1 / 16  # of the budget: the least a pass's later chunk takes (Scheduler.prefill_plan)


def _inputs(run: list[Sequence]) -> tuple[list[int], list[int], list[int], list[int]]:
    """A step's host inputs for its rows: each one's last token, slot, cached length and M-RoPE delta."""
    return [s.tokens[-1] for s in run], [s.slot for s in run], [s.length for s in run], [s.delta for s in run]


@dataclass
class Result:
    rid: int
    text: str
    tokens: list[int]
    seconds: float = 0.0  # admission to last token
    first_token_s: float = 0.0  # admission to first token
    # speculative decoding: the verify steps this request took part in, by the tokens each gave it
    # (accepted drafts + the target's own, before an EOS cut): gave[j] steps gave j + 1
    gave: list[int] = field(default_factory=list)

    @property
    def verifies(self) -> int:
        return sum(self.gave)

    @property
    def verified(self) -> int:
        return sum((j + 1) * n for j, n in enumerate(self.gave))

    @property
    def accepted_length(self) -> float | None:
        """Tokens per verify (1 to k+1; None without speculative decoding)."""
        return self.verified / self.verifies if self.verifies else None


class Engine:
    def __init__(self, checkpoint=None, config: RuntimeConfig | None = None, *, runner: ModelRunner | None = None,
                 processor=None, prefill_budget: int = PREFILL_BUDGET, spec: int | None = None):
        """From a checkpoint directory (None: the bundled model) and a RuntimeConfig, or from a
        built `runner` and `processor` (bench). prefill_budget: prompt tokens prefilled per step.
        spec: draft tokens per speculative step (the checkpoint's MTP drafts them; None: the
        config's, or the runner's; 0 with a speculative runner: plain decoding on it, as bench
        compares)."""
        if prefill_budget < 1:
            raise ValueError(f"prefill_budget must be at least 1 token, got {prefill_budget}")
        if runner is not None and spec not in (None, 0, runner.spec):
            raise ValueError(f"spec={spec}, but the runner was built with spec={runner.spec} (RuntimeConfig.spec; "
                             "0: plain decoding on it)")
        if runner is None and spec is not None:
            config = replace(config or RuntimeConfig(), spec=spec)
        self.runner = runner or ModelRunner(checkpoint, config)
        self.spec = self.runner.spec if spec is None else spec
        self.processor = processor or load_processor(resolve_model_dir(checkpoint))
        self.prefill_budget = prefill_budget
        tok = self.processor.tokenizer
        self.eos = {tok.convert_tokens_to_ids("<|im_end|>")}
        if tok.eos_token_id is not None:
            self.eos.add(tok.eos_token_id)

    def encode(self, page: Page) -> dict:
        return encode_page(self.processor, page, self.runner.model.dtype)  # the tower's dtype: half the bytes

    def generate(self, requests: Iterable[dict | tuple[dict, int]], max_new_tokens: int = 512,
                 max_batch: int | None = None, on_step: Callable[[int], None] | None = None,
                 stop_at_eos: bool = True) -> Iterator[Result]:
        """Greedy-decode encoded requests (or (request, its own max_new_tokens) pairs), pulled
        from `requests` as slots free; yields results as sequences finish, in any order (`rid`
        is the request's position in `requests`). With stop_at_eos False every request runs to
        its token limit (benchmarks)."""
        stops = self.eos if stop_at_eos else set()
        source = (r if isinstance(r, tuple) else (r, max_new_tokens) for r in requests)
        sched = Scheduler(source, self.runner.max_slots, max_batch)
        # every decode graph this batch can need, captured before serving (as bench always did): none mid-step
        self.runner.capture_buckets(sched.max_batch)
        if self.spec:
            yield from self._generate_spec(sched, stops, on_step)
            return
        pending = None  # a launched decode step whose tokens are not read yet: (its rows, PendingTokens)
        while True:
            if pending is None:
                sched.admit()
                if sched.idle:
                    return
                run = sched.decoding
                if any(s.prefilling for s in sched.running):
                    self._mixed_step(sched, run, stops)
                    if on_step and run:
                        on_step(len(run))
                    yield from self._finished(sched)
                    continue
                if not run:
                    yield from self._finished(sched)
                    continue
                pending = (run, self.runner.greedy_step(*_inputs(run)))
            run, got = pending
            # The next step goes out before this one's tokens are read, fed them on the device, so the
            # host's bookkeeping hides behind the GPU. Rows that this step's tokens finish get one token
            # too many there, dropped (the next prefill into their slot rewrites its state); then the
            # step after is built from the host, with admissions. A batch holding finished rows, or
            # one a row of which would pass max_len, is not chained.
            ahead = None
            if all(not s.done for s in run) and max(s.length for s in run) + 1 < self.runner.max_len:
                ahead = (run, self.runner.greedy_step(None, [s.slot for s in run], [s.length + 1 for s in run],
                                                       [s.delta for s in run]))
            live = [s for s in run if not s.done]
            for seq, nxt in zip(run, got.get()):
                if not seq.done:
                    seq.length += 1
                    self._append(seq, nxt, stops)
            if on_step:
                on_step(len(live))
            yield from self._finished(sched)
            pending = ahead

    def _mixed_step(self, sched: Scheduler, run: list[Sequence], stops: set[int]) -> None:
        """A step while requests prefill: the decode step of the running rows is launched first,
        then a prefill pass over this step's chunks queues behind it; the host reads the decode
        tokens while the GPU prefills. A prompt whose last chunk ran gets its first token."""
        got = None
        if run:
            got = self.runner.greedy_step(*_inputs(run))
        plan = sched.prefill_plan(self.prefill_budget, max(1, int(self.prefill_budget * MIN_CHUNK)))
        fresh = [seq for seq, _ in plan if seq.prompt is None]
        if fresh:  # the vision tower, once per page, ahead of its first text chunk
            for seq, prompt in zip(fresh, self.runner.encode([seq.enc for seq in fresh])):
                seq.prompt, seq.enc, seq.delta = prompt, None, prompt.delta
        logits = self.runner.prefill_chunks([(seq.prompt, chunk) for seq, chunk in plan], draft=bool(self.spec))
        if got is not None:
            for seq, nxt in zip(run, got.get()):
                seq.length += 1
                self._append(seq, nxt, stops)
        finished = [(seq, i) for i, (seq, chunk) in enumerate(plan) if chunk.start + chunk.n == seq.prompt_len]
        firsts = logits[[i for _, i in finished]].argmax(-1).tolist() if finished else []
        for (seq, _), tok in zip(finished, firsts):
            seq.prefilled = seq.length = seq.prompt_len
            seq.prompt = None  # its embeddings are in the cache now
            seq.t_first = time.perf_counter()
            self._append(seq, tok, stops)
        for seq, chunk in plan:
            seq.prefilled = max(seq.prefilled, chunk.start + chunk.n)

    def _generate_spec(self, sched: Scheduler, stops: set[int], on_step) -> Iterator[Result]:
        """generate's loop with speculative decoding (#55): each step runs one speculative step for
        the decoding rows (runner.spec_step: verify the drafts, commit, draft the next), then the
        step's prefill pass (_mixed_step with no decode rows; the MTP cache fills behind it, and a
        prompt that ends there gets its drafts). A row takes its tokens one by one, as greedy
        decoding would, and stops where that would: tokens after an EOS or past max_new_tokens are
        dropped (its slot is rewritten by the next prefill). With nothing prefilling, steps chain as
        generate's do: the next goes out, fed on the device, before this one's tokens are read."""
        pending = None  # a launched speculative step whose tokens are not read yet: (its rows, PendingSpec)
        k1 = self.runner.spec + 1
        while True:
            if pending is None:
                sched.admit()
                if sched.idle:
                    return
                run = sched.decoding
                got = None
                if run:
                    got = self.runner.spec_step(*_inputs(run))
                prefilling = any(s.prefilling for s in sched.running)
                if prefilling or got is None:  # a prefill pass behind the step; no chaining across it
                    if prefilling:
                        self._mixed_step(sched, [], stops)
                    if got is not None:
                        self._take(run, got, stops, on_step)
                    yield from self._finished(sched)
                    continue
                pending = (run, got)
            run, got = pending
            ahead = None  # the next step, chained: only rows that are not done, none that could pass max_len
            if got.chainable and all(not s.done for s in run) and \
                    max(s.length for s in run) + 2 * k1 < self.runner.max_len:
                ahead = (run, self.runner.spec_step(None, *_inputs(run)[1:]))
            self._take(run, got, stops, on_step)
            yield from self._finished(sched)
            pending = ahead

    def _take(self, run: list[Sequence], got, stops: set[int], on_step) -> None:
        """A speculative step's tokens into its rows, each cut where greedy decoding would stop."""
        for seq, toks in zip(run, got.get()):
            if seq.done:  # finished by the step before (chained): its tokens here are past its end
                continue
            seq.length += len(toks)
            seq.gave += [0] * (len(toks) - len(seq.gave))
            seq.gave[len(toks) - 1] += 1
            for t in toks:
                self._append(seq, t, stops)
                if seq.done:
                    break
        if on_step:
            on_step(len(run))

    def _finished(self, sched: Scheduler) -> Iterator[Result]:
        tok = self.processor.tokenizer
        for seq in sched.retire():
            yield Result(seq.rid, tok.decode(seq.tokens, skip_special_tokens=True).strip(), seq.tokens,
                         time.perf_counter() - seq.t_admit, seq.t_first - seq.t_admit, seq.gave)

    @staticmethod
    def _append(seq: Sequence, token: int, stops: set[int]) -> None:
        seq.tokens.append(token)
        if token in stops or len(seq.tokens) >= seq.max_new_tokens:
            seq.done = True
