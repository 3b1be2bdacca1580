"""Which sequences run: requests pulled from their source only when a slot is free (a backlog
of any size streams through), FIFO admission, prefill planned in chunks under a token budget,
retirement on EOS or length."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

from .layers import Chunk


@dataclass
class Sequence:
    rid: int
    enc: dict | None               # processor output for the prompt (batch of 1); dropped once encoded
    max_new_tokens: int
    slot: int = -1
    prompt: object = None          # models.qwen3_5.Prompt once encoded (the vision tower has run)
    prompt_len: int = 0
    prefilled: int = 0             # prompt tokens in the cache so far
    length: int = 0                # tokens in the cache
    delta: int = 0                 # M-RoPE offset of decode positions
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    t_admit: float = 0.0           # perf_counter at admission, for latency
    t_first: float = 0.0           # perf_counter at the first token
    gave: list[int] = field(default_factory=list)  # speculative steps by tokens given: gave[j] steps gave j+1

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prompt_len


class Scheduler:
    """requests: an iterator of (enc, max_new_tokens); `rid` is the position in it."""

    def __init__(self, requests: Iterator[tuple[dict, int]], max_slots: int, max_batch: int | None = None):
        self.source = requests
        self.free = list(range(max_slots))[::-1]
        self.max_batch = max_batch or max_slots
        self.running: list[Sequence] = []
        self.exhausted = False
        self._next_rid = 0

    def admit(self) -> list[Sequence]:
        """Pull requests into free slots (they need a prefill)."""
        out = []
        while not self.exhausted and self.free and len(self.running) < self.max_batch:
            req = next(self.source, None)
            if req is None:
                self.exhausted = True
                break
            enc, limit = req
            seq = Sequence(self._next_rid, enc, limit, slot=self.free.pop(), prompt_len=enc["input_ids"].shape[-1],
                           t_admit=time.perf_counter())
            self._next_rid += 1
            self.running.append(seq)
            out.append(seq)
        return out

    def prefill_plan(self, budget: int, min_chunk: int = 1) -> list[tuple[Sequence, Chunk]]:
        """This step's prefill chunks: admitted sequences in order, each taking what is left of
        the budget (at least one chunk per step, however small the budget). A chunk after the
        first takes at least min_chunk tokens or the rest of its prompt: every chunk launches its own
        conv and attention in every layer, whatever its size, so a sliver left by the budget waits
        for the next pass."""
        plan = []
        for seq in self.running:
            if budget <= 0:
                break
            if seq.prefilling:
                n = min(seq.prompt_len - seq.prefilled, budget)
                if plan and n < min(min_chunk, seq.prompt_len - seq.prefilled):
                    break
                plan.append((seq, Chunk(seq.slot, seq.prefilled, n)))
                budget -= n
        return plan

    @property
    def decoding(self) -> list[Sequence]:
        return [s for s in self.running if not s.prefilling and not s.done]

    def retire(self) -> list[Sequence]:
        """Remove finished sequences and free their slots."""
        done = [s for s in self.running if s.done]
        for s in done:
            self.free.append(s.slot)
        self.running = [s for s in self.running if not s.done]
        return done

    @property
    def idle(self) -> bool:
        return self.exhausted and not self.running
