"""Speculative decoding (#55): the MTP drafts, a verify scores k+1 positions per row in one pass, a
commit rolls each row back to its accepted prefix, and the tokens are exactly greedy decoding's.

A tiny random Qwen3.5 (init std 0.1, so that greedy output varies) with a random MTP layer: its
drafts are poor, so an oracle drafter (the MTP still runs, then its drafts are replaced by the true
greedy continuation, some made wrong on purpose) drives every acceptance path — all k drafts, some,
none — with rows of different accepted lengths in one batch."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest
import torch

from ocriaquant.errors import OcriaError
from ocriaquant.runtime.config import RuntimeConfig
from ocriaquant.runtime.engine import Engine
from ocriaquant.runtime.model_runner import ModelRunner

PROMPTS = (9, 13, 11)  # prompt lengths, distinct: the oracle tells requests apart by them
LIMITS = (23, 9, 17)


@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory):
    """A tiny Qwen3.5 with an MTP layer (model/mtp.py's save_mtp) and a processor."""
    from transformers import Qwen3_5ForConditionalGeneration

    from ocriaquant.model import tiny_config
    from ocriaquant.model.mtp import Qwen35MTP, save_mtp
    from ocriaquant.model.processor import save_processor
    from ocriaquant.model.reference import reference_processor

    out = tmp_path_factory.mktemp("tiny-mtp")
    cfg = tiny_config()
    cfg.initializer_range = cfg.text_config.initializer_range = 0.1
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg)
    model.save_pretrained(out)
    save_processor(reference_processor(max_pixels=256 * 320), out)
    save_mtp(out, Qwen35MTP(model.config.text_config))
    return out


@pytest.fixture(scope="module")
def requests():
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(0, 250, (1, n), generator=g)} for n in PROMPTS]


@pytest.fixture(scope="module")
def greedy(spec_dir, requests):
    """Non-speculative greedy tokens per request, run to their limits (no EOS), and the engine."""
    engine = Engine(spec_dir, RuntimeConfig(max_slots=2, max_len=64))
    res = engine.generate(list(zip(requests, LIMITS)), max_batch=2, stop_at_eos=False)
    return {r.rid: r.tokens for r in res}, engine


def wrong_at(turn: int, k: int) -> int:
    """Which draft (1 … k; k+1: none) the oracle spoils on a slot's `turn`-th drafting: by turns none
    (all k accepted), one in the middle (some), the first (none), the last."""
    return [k + 1, 1 + (turn // 4) % k, 1, k][turn % 4]


def oracle(runner: ModelRunner, requests, tokens: dict[int, list[int]]) -> tuple[list[list[int]], list[bool]]:
    """Make `runner` verify the true greedy continuation (spoiled per wrong_at) in place of its MTP's
    drafts: written into runner.drafts from the host before each spec_step (so a step's CUDA graph
    reads them as it reads the MTP's); returns the lists each spec_step's accepted lengths, and
    whether it was chained (launched from the device before the last one's tokens were read), are
    appended to."""
    full = {r["input_ids"].shape[1]: r["input_ids"][0].tolist() + tokens[i] for i, r in enumerate(requests)}
    owner, steps, chained, turns = {}, [], [], {}
    prefill, step = runner.prefill_chunks, runner.spec_step
    vocab = runner.hf_config.text_config.vocab_size

    def prefill_chunks(parts, **kw):
        owner.update({c.slot: p.length for p, c in parts if c.start == 0})
        return prefill(parts, **kw)

    def spec_step(tokens, slots, lengths, deltas, **kw):
        k = runner.spec
        if tokens is None:  # chained: the rows' lengths are on the device, where the last step left them
            _, bucket, nxt = runner._last_spec
            meta = nxt if bucket is None else runner._spec_graphs[bucket, 1 - runner._pending[1]][1]
            lengths = meta[2, :len(slots)].tolist()
        rows = []
        for s, n in zip(slots, lengths):  # the row's last token is seq[n]; its drafts seq[n+1 … n+k]
            seq = full[owner[s]]
            row = [seq[n + j] if n + j < len(seq) else 0 for j in range(1, k + 1)]
            turns[s] = turns.get(s, -1) + 1
            bad = wrong_at(turns[s] + s, k)  # slots out of step: rows of one batch accept differently
            if bad <= k:
                row[bad - 1] = (row[bad - 1] + 1) % vocab
            rows.append(row)
        runner.drafts[torch.tensor(slots, device=runner.device)] = torch.tensor(rows, device=runner.device)
        chained.append(tokens is None)
        got = step(tokens, slots, lengths, deltas, **kw)
        steps.append([len(t) for t in got.get()])
        return got

    runner.prefill_chunks, runner.spec_step = prefill_chunks, spec_step
    return steps, chained


def test_verify_then_commit_equals_sequential_decode(spec_dir):
    """Verify T = 4 tokens on two slots, commit 3 and 1 (and 4 and 2): the GDN recurrent and conv
    states equal those of that many decode steps, the KV prefix too, and every verified position's
    logits equal the decode step's (bit for bit on the CPU)."""
    rt = ModelRunner(spec_dir, RuntimeConfig(max_slots=3, max_len=40, spec=3))
    ref = ModelRunner(spec_dir, RuntimeConfig(max_slots=3, max_len=40))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 250, (1, n), generator=g) for n in (8, 5)]
    slots, lengths = torch.tensor([2, 0]), torch.tensor([8, 5])
    tokens = torch.randint(0, 250, (2, 4), generator=g)
    gdn = [i for i, layer in enumerate(rt.model.layers) if layer.mixer.__class__.__name__ == "GatedDeltaNet"]
    attn = [i for i in range(len(rt.model.layers)) if i not in gdn]
    for accepted in ([3, 1], [4, 2]):
        for r in (rt, ref):
            for s, p in zip(slots.tolist(), prompts):
                r.prefill({"input_ids": p}, slot=s)
        scratch = rt._scratch(4)
        logits, hidden = rt.model.verify(tokens, slots, lengths, torch.zeros(2, dtype=torch.long), rt.state, scratch,
                                         span=int(lengths.max()) + 4)
        rt.model.commit(rt.state, scratch, slots, torch.tensor(accepted))
        for b, (s, n) in enumerate(zip(slots.tolist(), accepted)):
            for t in range(4):  # decode the row's tokens one by one on the reference runner
                want = ref.decode(tokens[b, t:t + 1], torch.tensor([s]), lengths[b:b + 1] + t, torch.tensor([0]))
                assert torch.equal(logits[b, t], want[0]), (accepted, b, t)
                if t + 1 == n:
                    kept = {i: {k: v[s].clone() for k, v in ref.state[i].items()} for i in gdn}
            for i in gdn:  # the conv window exactly; the fp32 state to its last bits, as decode at another
                # batch size gives it (the CPU's vectorized exp / softplus round a tensor's tail apart)
                assert torch.equal(rt.state[i]["conv"][s], kept[i]["conv"]), (accepted, b, i)
                torch.testing.assert_close(rt.state[i]["ssm"][s], kept[i]["ssm"], rtol=1e-5, atol=1e-6)
            for i in attn:
                end = int(lengths[b]) + n
                assert torch.equal(rt.state[i]["k"][s, :, :end], ref.state[i]["k"][s, :, :end])
        assert hidden.shape == (2, 4, rt.hf_config.text_config.hidden_size)


def test_runtime_mtp_is_model_mtp(spec_dir):
    """The runtime's MTP layer (models/mtp.py, on our own layers) computes what model/mtp.py's
    Qwen35MTP (transformers' decoder layer, the math vLLM runs) computes from the same checkpoint,
    in a prefill pass and as decode rows."""
    from ocriaquant.model import load_config
    from ocriaquant.model.mtp import load_mtp
    from ocriaquant.runtime.layers import Chunk

    rt = ModelRunner(spec_dir, RuntimeConfig(max_slots=1, max_len=32, spec=1))
    ref = load_mtp(spec_dir, load_config(spec_dir).text_config, torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    dim = rt.hf_config.text_config.hidden_size
    e, h = (torch.randn(10, dim, generator=g).to(torch.bfloat16) for _ in range(2))
    cos, sin = rt.model.rope(torch.arange(10)[None].expand(3, -1))
    with torch.no_grad():
        want = ref(e[None], h[None], (cos[None], sin[None]))[0]
    got = rt.mtp.prefill(e, h, rt.mtp_state, [Chunk(0, 0, 10)], cos, sin)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # the last 4 positions again as decode rows of slot 0, over the cache the prefill wrote
    _, step = rt.model.step(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), torch.arange(6, 10),
                            torch.zeros(4, dtype=torch.long), span=10)
    rows = rt.mtp.decode(e[6:], h[6:], rt.mtp_state, step)
    torch.testing.assert_close(rows, want[6:], rtol=2e-2, atol=2e-2)


def test_mtp_chain_trains_what_the_runtime_drafts(spec_dir):
    """Qwen35MTP.chain (what scripts/train_mtp.py trains draft steps 2..k on) gives at every position what the
    runtime's draft chain computes there: step 1 as a prefill over the verified positions; step j at position s
    from step j-1's output at s-1, over a cache holding the verified positions and the chain's own."""
    from ocriaquant.model import load_config
    from ocriaquant.model.mtp import load_mtp
    from ocriaquant.runtime.layers import Chunk

    rt = ModelRunner(spec_dir, RuntimeConfig(max_slots=1, max_len=32, spec=1))
    ref = load_mtp(spec_dir, load_config(spec_dir).text_config, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    dim, n, L = rt.hf_config.text_config.hidden_size, 12, 8  # positions 0..L-1 verified, L.. drafted
    e, h = (torch.randn(n, dim, generator=g).to(torch.bfloat16) for _ in range(2))
    cos, sin = rt.model.rope(torch.arange(n)[None].expand(3, -1))
    with torch.no_grad():
        steps = ref.chain(e[None], h[None], (cos[None], sin[None]), 3)
        torch.testing.assert_close(steps[0], ref(e[None], h[None], (cos[None], sin[None])), rtol=1e-2, atol=1e-2)
    steps = [s[0] for s in steps]
    first = rt.mtp.prefill(e[:L], h[:L], rt.mtp_state, [Chunk(0, 0, L)], cos[:L], sin[:L])
    torch.testing.assert_close(first, steps[0][:L], rtol=2e-2, atol=2e-2)
    out = first[L - 1:L]
    for j in (2, 3):  # the chain's step j at position L+j-2, fed the step before's output
        pos = L + j - 2
        _, step = rt.model.step(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                torch.tensor([pos]), torch.zeros(1, dtype=torch.long), span=pos + 1)
        out = rt.mtp.decode(e[pos:pos + 1], out, rt.mtp_state, step)
        torch.testing.assert_close(out[0], steps[j - 1][pos], rtol=2e-2, atol=2e-2)
    # and chained inputs matter: step 2 differs from step 1 at the same position
    assert (steps[1][L] - steps[0][L]).abs().max() > 0.1


@pytest.mark.parametrize("k", [1, 2, 4])
def test_spec_tokens_equal_greedy_on_every_acceptance_path(k, spec_dir, requests, greedy):
    """Three requests through two slots (one joins as another finishes), token limits and an EOS that
    cut accepted runs mid-way: the tokens equal greedy decoding's; steps accepted all k drafts, some
    and none, with rows of different accepted lengths in one step."""
    tokens, base = greedy
    stop = tokens[0][6]  # an EOS for request 0 a few tokens in (it may occur in the others too)
    plain = Engine(runner=base.runner, processor=base.processor)
    plain.eos = {stop}
    want = {r.rid: r.tokens for r in plain.generate(list(zip(requests, LIMITS)), max_batch=2)}
    assert want[0] == tokens[0][:7]
    engine = Engine(spec_dir, RuntimeConfig(max_slots=2, max_len=64), processor=base.processor, spec=k)
    engine.eos = {stop}
    steps, chained = oracle(engine.runner, requests, tokens)
    res = list(engine.generate(list(zip(requests, LIMITS)), max_batch=2))
    assert {r.rid: r.tokens for r in res} == want
    assert k == 1 or any(r.verified > len(r.tokens) - 1 for r in res)  # a run cut by EOS or the limit mid-way
    seen = {n for row in steps for n in row}
    assert {1, k + 1} <= seen and (k == 1 or seen - {1, k + 1})
    assert any(len(set(row)) > 1 for row in steps)
    assert all(r.verifies > 0 and 1 <= r.accepted_length <= k + 1 for r in res)
    assert any(chained) and not all(chained)  # steps launched from the device, and from the host


def test_spec_with_the_random_mtp_and_chunked_prefill(spec_dir, requests, greedy):
    """The MTP's own (poor) drafts, scored by a cheaper head (FP8, the lowest 100 ids), prompts
    prefilled in chunks of 5 tokens while the other slot decodes speculatively, and a cache just long
    enough (rows near max_len verify fewer drafts): greedy's tokens."""
    tokens, base = greedy
    cfg = RuntimeConfig(max_slots=2, max_len=max(p + n for p, n in zip(PROMPTS, LIMITS)) - 1, draft="fp8",
                        draft_vocab=100)
    engine = Engine(spec_dir, cfg, processor=base.processor, spec=4, prefill_budget=5)
    eos = engine.runner.hf_config.text_config.eos_token_id
    assert engine.runner.draft_head.kind == "fp8" and engine.runner.draft_ids.tolist() == list(range(100)) + [eos]
    assert engine.runner.mtp.fc.kind == engine.runner.mtp.mlp.down_proj.kind == "fp8"  # the MTP's Linears too
    calls = []
    prefill = engine.runner.prefill_chunks
    engine.runner.prefill_chunks = lambda parts, **kw: calls.append([c for _, c in parts]) or prefill(parts, **kw)
    res = list(engine.generate(list(zip(requests, LIMITS)), max_batch=2, stop_at_eos=False))
    assert {r.rid: r.tokens for r in res} == tokens
    assert any(c.start > 0 for p in calls for c in p)
    assert len(engine.runner._scratches) > 1  # steps of fewer than k + 1 positions near max_len


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the triton backend needs a GPU or TRITON_INTERPRET=1")
def test_spec_on_the_triton_backend_equals_its_greedy(spec_dir, requests):
    """The triton backend's verify and deferred commit (kernels/gdn_verify.py: a step's GDN commit done
    inside the next verify; attention through qk_norm_rope + attn_decode on B·(k+1) rows): its greedy
    tokens, on every acceptance path (oracle drafts), three requests through two slots (one joins
    a slot whose last step was never committed; rows of a step map to different rows of the last);
    on a GPU through the (bucket, parity) graphs."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = RuntimeConfig(max_slots=2, max_len=32, backend="triton", device=dev)
    limits = [7, 3, 5]
    base = Engine(spec_dir, cfg)
    tokens = {r.rid: r.tokens for r in base.generate(list(zip(requests, limits)), max_batch=2, stop_at_eos=False)}
    engine = Engine(spec_dir, cfg, processor=base.processor, spec=2)
    steps, chained = oracle(engine.runner, requests, tokens)
    maps, rows_of = [], engine.runner._pending_rows
    engine.runner._pending_rows = lambda slots: maps.append(rows_of(slots)[1]) or rows_of(slots)
    assert {r.rid: r.tokens for r in engine.generate(list(zip(requests, limits)), max_batch=2,
                                                      stop_at_eos=False)} == tokens
    assert engine.runner.deferred and {1, 2, 3} <= {n for row in steps for n in row} and any(chained)
    assert any(j >= 0 for m in maps for j in m) and any(-1 in m for m in maps[1:])  # committed in a verify; fresh


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the triton backend needs a GPU or TRITON_INTERPRET=1")
def test_a_plain_step_after_speculative_steps_commits_what_they_left_pending(spec_dir, requests):
    """The triton backend defers a speculative step's GDN commit into the next verify; a plain decode
    step on the same slot commits it first (flush): prefill, two speculative steps, then plain
    steps give greedy decoding's tokens, and the steps with nothing pending leave nothing."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = RuntimeConfig(max_slots=2, max_len=32, backend="triton", device=dev, cuda_graphs=False)
    req = requests[0]

    def first(rt):
        logits, delta = rt.prefill(req, slot=0)
        return [int(logits.argmax())], req["input_ids"].shape[1], delta

    plain = ModelRunner(spec_dir, cfg)
    want, n, delta = first(plain)
    for _ in range(8):
        want += plain.greedy_step([want[-1]], [0], [n], [delta]).get()
        n += 1
    rt = ModelRunner(spec_dir, replace(cfg, spec=2))
    got, n, delta = first(rt)
    for _ in range(2):
        toks = rt.spec_step([got[-1]], [0], [n], [delta]).get()[0]
        got, n = got + toks, n + len(toks)
    assert rt._pending is not None  # the last step's commit waits
    while len(got) < len(want):
        got += rt.greedy_step([got[-1]], [0], [n], [delta]).get()
        n += 1
        assert rt._pending is None
    assert got[:len(want)] == want


def test_parse_spec_gives_the_markdown_of_parse_and_its_accepted_length(tmp_path):
    """`ocriaquant parse --spec 2 --draft fp8` on a held-out page with the bundled model's trained MTP layer:
    the markdown of --spec 0, and summary.json reports an accepted length a random drafter (~1.0) never reaches,
    with its distribution, which `bench --acceptance` reads as it is."""
    from ocriaquant.data import BUNDLED_PAGES, load_pages, split_pages
    from ocriaquant.model import DEFAULT_MODEL
    from ocriaquant.parse import ParseOptions, parse

    _, held = split_pages(load_pages(BUNDLED_PAGES).pages)
    pages = tmp_path / "pages"
    pages.mkdir()
    shutil.copy(held[0].source, pages)
    out = {}
    for spec in (0, 2):
        opts = ParseOptions(max_new_tokens=40, read_workers=0, spec=spec, draft="fp8" if spec else "bf16")
        s = parse(DEFAULT_MODEL, pages, tmp_path / f"out{spec}", opts)
        assert s["parsed"] == 1
        out[spec] = (tmp_path / f"out{spec}" / f"{held[0].source.stem}.md").read_text()
    assert out[2] == out[0] and out[0].strip()
    assert s["spec"] == 2 and 1.5 <= s["accepted_length"] <= 3 and s["verify_steps"] > 0
    probs = s["accepted_length_probs"]
    assert len(probs) <= 3 and abs(sum(probs) - 1) < 1e-4 and probs[-1] > 0
    assert abs(sum((j + 1) * p for j, p in enumerate(probs)) - s["accepted_length"]) < 2e-3
    from ocriaquant.runtime.measure import accepted_lengths

    summary = json.loads((tmp_path / "out2" / "summary.json").read_text())
    assert accepted_lengths(summary, 2) == pytest.approx(probs + [0.0] * (3 - len(probs)))


def test_bench_spec_times_the_step_and_expects_the_given_acceptance(spec_dir, tmp_path):
    """`bench --spec 2 --acceptance FILE`: the step's phases timed, the expected tokens per step from
    the file (said to be given, not measured); a named shape without --acceptance is refused."""
    from ocriaquant import bench
    from ocriaquant.runtime.measure import accepted_lengths

    assert accepted_lengths({"position_acceptance": [0.5, 0.5, 0.5]}, 2) == [0.5, 0.25, 0.25]
    assert accepted_lengths([0.25, 0.25, 0.25, 0.25], 2) == [0.25, 0.25, 0.5]
    with pytest.raises(ValueError, match="sum to 1"):
        accepted_lengths([0.5, 0.2], 2)
    with pytest.raises(ValueError, match="parse --spec"):  # neither key, or both
        accepted_lengths({"accepted_length": 2.5}, 2)
    with pytest.raises(ValueError, match="parse --spec"):
        accepted_lengths({"accepted_length_probs": [1.0], "position_acceptance": [0.5]}, 2)
    acc = tmp_path / "acceptance.json"
    acc.write_text(json.dumps({"position_acceptance": [0.8, 0.5]}))
    rep = bench.run(spec_dir, bench.BenchOptions(device="cpu", backend="torch", batches=(2,), context=8, steps=1,
                                                 concurrency=(2,), pages=2, out_tokens=5, baseline=False,
                                                 megapixels=0.2, spec=2, acceptance=acc), log=lambda m: None)
    # pages served both ways on the one runner: plain decoding, then speculative (the checkpoint's MTP:
    # its acceptance measured, not simulated)
    (plain,), (spec,) = rep["pages_plain"], rep["pages"]
    assert plain["concurrency"] == spec["concurrency"] == 2 and "accepted_length" not in plain
    assert 1 <= spec["accepted_length"] <= 3 and not rep["spec"]["simulated_acceptance"]
    sp = rep["spec"]
    assert sp["k"] == 2 and "given, not measured" in sp["acceptance"]
    assert sp["expected_accepted_length"] == pytest.approx(1 + 0.8 + 0.4)
    (row,) = sp["steps"]
    assert row["batch"] == 2 and row["eager_step_ms"] >= row["verify_ms"] > 0 and row["draft_ms"] > 0
    assert row["speedup_at"] == {str(a): pytest.approx(a * row["plain_step_ms"] / row["step_ms"], rel=0.02, abs=0.006)
                                 for a in (1.5, 2, 2.5, 3)}  # accepted lengths up to k + 1; rounded to 0.01
    assert row["expected_tok_per_s"] == pytest.approx(2 * 2.2 / (row["step_ms"] / 1e3), rel=0.01)
    with pytest.raises(OcriaError, match="--acceptance"):
        bench.run(None, bench.BenchOptions(shape="qwen3.5-0.8b", device="cpu", backend="torch", spec=2),
                  log=lambda m: None)


@pytest.mark.parametrize("probs, tokens", [([0, 0, 1], 3.0), ([1, 0, 0], 1.0)])
def test_simulated_acceptance_sets_the_tokens_a_step_gives(spec_dir, requests, probs, tokens):
    """bench's random-weights mode: each step's rows accept as many drafts as drawn from the given
    distribution (here certain), whatever the target says; set after a graph exists it is refused."""
    engine = Engine(spec_dir, RuntimeConfig(max_slots=2, max_len=64), spec=2)
    engine.runner.simulate_acceptance(probs)
    res = list(engine.generate([(r, 7) for r in requests[:2]], max_batch=2, stop_at_eos=False))
    assert all(len(r.tokens) == 7 for r in res)
    assert all(r.verified == tokens * r.verifies for r in res)  # every verify gave `tokens` tokens
    with pytest.raises(ValueError, match="3 probabilities"):
        engine.runner.simulate_acceptance([1.0])
    engine.runner._spec_graphs[1, 0] = None
    with pytest.raises(OcriaError, match="before the speculative graphs"):
        engine.runner.simulate_acceptance(probs)


def test_spec_needs_an_mtp_layer(tiny_model_dir):
    with pytest.raises(OcriaError, match=f"{tiny_model_dir}.*has no MTP layer"):
        ModelRunner(tiny_model_dir, RuntimeConfig(max_slots=1, spec=2))
    with pytest.raises(OcriaError, match="0 to 8 draft tokens"):
        RuntimeConfig(spec=9)


def test_info_says_whether_a_checkpoint_can_draft(spec_dir, tiny_model_dir):
    """`ocriaquant info` counts the checkpoint's mtp.* tensors (headers only) and says what --spec needs."""
    from io import StringIO

    from rich.console import Console

    from ocriaquant.info import model_info, render_info
    from ocriaquant.model.mtp import mtp_keys

    with_mtp, without = model_info(spec_dir), model_info(tiny_model_dir)
    assert with_mtp.mtp_tensors == len(mtp_keys(spec_dir)) > 0 and without.mtp_tensors == 0
    assert model_info(shape="qwen3.5-4b").mtp_tensors is None
    for info, said in ((with_mtp, "the drafter of speculative decoding"), (without, "`--spec` needs one")):
        out = StringIO()
        render_info(info, Console(file=out, width=200))
        assert said in out.getvalue()
