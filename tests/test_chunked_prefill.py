"""Chunked prefill: a prompt prefilled in chunks of any size, interleaved with other requests'
decode steps and chunks, gives the tokens of a whole prefill."""

from __future__ import annotations

import pytest
import torch

from ocriaquant.data import BUNDLED_PAGES, load_pages, split_pages
from ocriaquant.runtime.config import RuntimeConfig
from ocriaquant.runtime.engine import Engine


def _run(engine, encs, limits):
    """Tokens by request, and the engine's calls in order: ("decode", rows) / ("prefill", chunks)."""
    runner, calls = engine.runner, []
    decode, prefill = runner.greedy_step, runner.prefill_chunks

    def greedy_step(tokens, slots, *rest):
        calls.append(("decode", len(slots)))
        return decode(tokens, slots, *rest)

    def prefill_chunks(parts, **kw):
        calls.append(("prefill", [c for _, c in parts]))
        return prefill(parts, **kw)

    runner.greedy_step, runner.prefill_chunks = greedy_step, prefill_chunks
    try:
        res = list(engine.generate(list(zip(encs, limits)), max_batch=2))
    finally:
        del runner.greedy_step, runner.prefill_chunks
    return {r.rid: r.tokens for r in res}, calls


@pytest.mark.parametrize("which", ["bf16", "mixed"])
def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill(which, request):
    """Three held-out pages of 371 prompt tokens, two slots: with a budget of 37 (off the delta
    rule's 64-token chunks) every page spans eleven passes; a page is admitted
    while the other slot decodes, and chunks of two pages share a pass. Tokens equal those of
    whole-page prefills, which test_runtime checks against transformers."""
    ckpt = None if which == "bf16" else request.getfixturevalue("mixed_checkpoint")
    _, held = split_pages(load_pages(BUNDLED_PAGES).pages)
    limits = [8, 12, 4]
    whole = Engine(ckpt, RuntimeConfig(max_slots=2), prefill_budget=100_000)
    encs = [whole.encode(p) for p in held[:3]]
    n = encs[0]["input_ids"].shape[1]
    assert all(e["input_ids"].shape[1] == n for e in encs) and n > 300
    want, calls = _run(whole, encs, limits)
    assert [len(want[i]) for i in range(3)] == limits
    assert all(len(c[1]) <= 2 and all(ch.start == 0 and ch.n == n for ch in c[1]) for c in calls if c[0] == "prefill")
    budget = 37
    got, calls = _run(Engine(runner=whole.runner, processor=whole.processor, prefill_budget=budget), encs, limits)
    assert got == want, which
    passes = [c[1] for c in calls if c[0] == "prefill"]
    assert all(sum(ch.n for ch in p) <= budget for p in passes)
    assert sum(ch.n for p in passes for ch in p) == 3 * n  # every prompt token prefilled once
    assert any(len(p) == 2 for p in passes)  # one page's last chunk and the next page's first
    # a continuing chunk (start > 0) right after a decode step of the other slot: admission mid-decode
    assert any(a[0] == "decode" and b[0] == "prefill" and any(ch.start > 0 for ch in b[1])
               for a, b in zip(calls, calls[1:]))


def test_a_pass_leaves_a_sliver_of_the_budget_for_the_next():
    """Two 4,084-token pages under a 4,096-token budget: the second page waits for the next pass
    rather than prefill 12 tokens (a chunk launches its own conv and attention in every layer
    whatever its size); a chunk that ends its prompt, or takes min_chunk, still joins."""
    from ocriaquant.runtime.scheduler import Scheduler

    def plan(remaining: list[int], budget=4096, min_chunk=256):
        sched = Scheduler(iter([({"input_ids": torch.zeros(1, 4084)}, 8)] * len(remaining)), max_slots=4)
        for seq, left in zip(sched.admit(), remaining):
            seq.prefilled = seq.prompt_len - left
        return [(c.start, c.n) for _, c in sched.prefill_plan(budget, min_chunk)]

    assert plan([4084, 4084]) == [(0, 4084)]
    assert plan([4084, 4084], min_chunk=1) == [(0, 4084), (0, 12)]
    assert plan([3000, 4084]) == [(1084, 3000), (0, 1096)]
    assert plan([4084, 10]) == [(0, 4084), (4074, 10)]  # ends its prompt
    assert plan([4084, 4084, 4084], budget=100) == [(0, 100)]  # the first chunk whatever the budget


def test_a_pass_of_several_chunks_goes_to_fla_core_as_one_varlen_call():
    """The host-made varlen inputs of a pass (fla-core's GPU path takes all its chunks in one call):
    sequence bounds, one (sequence, chunk) index per 64-row chunk as fla-core counts them, the
    slots the final states go back to; made once per layout."""
    from ocriaquant.runtime.layers.gdn import FLA_CHUNK, varlen_inputs

    layout = ((70, 0), (50, 2), (9, 1))
    cu, cu_host, indices, slots = varlen_inputs(layout, torch.device("cpu"))
    assert FLA_CHUNK == 64 and cu.tolist() == cu_host.tolist() == [0, 70, 120, 129]
    assert indices.tolist() == [[0, 0], [0, 1], [1, 0], [2, 0]] and slots.tolist() == [0, 2, 1]
    assert varlen_inputs(layout, torch.device("cpu"))[2] is indices


def test_prefill_budget_is_checked():
    with pytest.raises(ValueError, match="prefill_budget"):
        Engine(None, RuntimeConfig(max_slots=1), prefill_budget=0)
