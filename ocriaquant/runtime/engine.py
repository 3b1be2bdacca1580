"""The engine: page requests in, markdown out. Prefills each admitted request into its slot,
then decodes all running sequences together one token a step (continuous batching: finished
sequences leave and waiting ones join between steps)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from ..data.page import Page
from ..model.load import resolve_model_dir
from ..model.processor import chat_text, load_processor
from .config import RuntimeConfig
from .model_runner import ModelRunner
from .scheduler import Scheduler, Sequence


@dataclass
class Result:
    rid: int
    text: str
    tokens: list[int]
    seconds: float = 0.0  # admission (prefill start) to last token


class Engine:
    def __init__(self, checkpoint=None, config: RuntimeConfig | None = None, *, runner: ModelRunner | None = None,
                 processor=None):
        """From a checkpoint directory (None: the bundled model) and a RuntimeConfig, or from a
        built `runner` and `processor` (bench)."""
        self.runner = runner or ModelRunner(checkpoint, config)
        self.processor = processor or load_processor(resolve_model_dir(checkpoint))
        tok = self.processor.tokenizer
        self.eos = {tok.convert_tokens_to_ids("<|im_end|>")}
        if tok.eos_token_id is not None:
            self.eos.add(tok.eos_token_id)

    def encode(self, page: Page) -> dict:
        enc = self.processor(images=[page.image], text=[chat_text(self.processor, page.prompt)], return_tensors="pt")
        return dict(enc)

    def generate(self, requests: Iterable[dict | tuple[dict, int]], max_new_tokens: int = 512,
                 max_batch: int | None = None, on_step: Callable[[int], None] | None = None,
                 stop_at_eos: bool = True) -> Iterator[Result]:
        """Greedy-decode encoded requests (or (request, its own max_new_tokens) pairs); yields
        results as sequences finish, in any order (`rid` is the request's index). With
        stop_at_eos False every request runs to its token limit (benchmarks)."""
        stops = self.eos if stop_at_eos else set()
        sched = Scheduler(self.runner.max_slots, max_batch)
        for rid, req in enumerate(requests):
            enc, limit = req if isinstance(req, tuple) else (req, max_new_tokens)
            sched.add(Sequence(rid, enc, limit))
        pending = None  # a launched decode step whose tokens are not read yet: (its rows, PendingTokens)
        while not sched.idle:
            if pending is None:
                for seq in sched.admit():
                    seq.t_admit = time.perf_counter()
                    logits, seq.delta = self.runner.prefill(seq.enc, seq.slot)
                    seq.length = seq.enc["input_ids"].shape[1]
                    self._append(seq, int(logits.argmax()), stops)
                yield from self._finished(sched)  # a request can end at its first token
                run = sched.running
                if not run:
                    continue
                pending = (run, self.runner.greedy_step([s.tokens[-1] for s in run], [s.slot for s in run],
                                                         [s.length for s in run], [s.delta for s in run]))
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

    def _finished(self, sched: Scheduler) -> Iterator[Result]:
        tok = self.processor.tokenizer
        for seq in sched.retire():
            yield Result(seq.rid, tok.decode(seq.tokens, skip_special_tokens=True).strip(), seq.tokens,
                         time.perf_counter() - seq.t_admit)

    @staticmethod
    def _append(seq: Sequence, token: int, stops: set[int]) -> None:
        seq.tokens.append(token)
        if token in stops or len(seq.tokens) >= seq.max_new_tokens:
            seq.done = True
