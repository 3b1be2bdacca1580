"""Which sequences run this step: FIFO admission into free slots, retirement on EOS or length."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Sequence:
    rid: int
    enc: dict                      # processor output for the prompt (batch of 1)
    max_new_tokens: int
    slot: int = -1
    length: int = 0                # tokens in the cache
    delta: int = 0                 # M-RoPE offset of decode positions
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    t_admit: float = 0.0           # perf_counter at admission, for latency


class Scheduler:
    def __init__(self, max_slots: int, max_batch: int | None = None):
        self.free = list(range(max_slots))[::-1]
        self.max_batch = max_batch or max_slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots (they need a prefill)."""
        out = []
        while self.waiting and self.free and len(self.running) < self.max_batch:
            seq = self.waiting.popleft()
            seq.slot = self.free.pop()
            self.running.append(seq)
            out.append(seq)
        return out

    def retire(self) -> list[Sequence]:
        """Remove finished sequences and free their slots."""
        done = [s for s in self.running if s.done]
        for s in done:
            self.free.append(s.slot)
        self.running = [s for s in self.running if not s.done]
        return done

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
