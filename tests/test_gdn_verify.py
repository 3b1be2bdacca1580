"""Speculative decoding for GDN layers (kernels/gdn_verify.py): gdn_verify's outputs equal T sequential decode
steps and gdn_commit leaves each slot as if exactly its accepted tokens had been decoded, in both designs
("states": every intermediate state kept; "replay": the step inputs kept, the accepted prefix replayed),
against float64 references (kernels/reference.py's gdn_verify_ref, T gdn_decode_ref steps) on fresh random
inputs with NaN-poisoned outputs. On the CPU under TRITON_INTERPRET=1 at small shapes;
benchmarks/kernels_gdn_verify.py runs the same checks at Qwen3.5-4B shapes on the GPU."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
pytest.importorskip("triton")

from ocriaquant.runtime.kernels.gdn_decode import gdn_decode  # noqa: E402
from ocriaquant.runtime.kernels.gdn_verify import (DESIGNS, Pending, gdn_commit, gdn_verify,  # noqa: E402
                                                   spec_scratch)
from ocriaquant.runtime.kernels.reference import gdn_verify_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(H=2, HV=4, K=16, V=16)  # the brief's small shape: C = 128 channels, conv kernel 4


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _rand(g, *shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def _weights(H, HV, K, V, seed, kw=4):
    g = _gen(seed)
    C = 2 * H * K + HV * V
    return dict(conv_weight=_rand(g, C, kw, scale=0.5), A_log=_rand(g, HV, scale=0.5, dtype=torch.float32),
                dt_bias=_rand(g, HV, dtype=torch.float32), norm_weight=_rand(g, V, scale=0.3) + 1)


def _states(slots, H, HV, K, V, seed, kw=4):
    g = _gen(seed)
    C = 2 * H * K + HV * V
    return dict(conv_state=_rand(g, slots, C, kw - 1), state=_rand(g, slots, HV, V, K, scale=0.2, dtype=torch.float32))


def _tokens(bsz, T, H, HV, K, V, seed):
    g = _gen(seed)
    C = 2 * H * K + HV * V
    return dict(qkv=_rand(g, bsz, T, C), z=_rand(g, bsz, T, HV * V), a=_rand(g, bsz, T, HV), b=_rand(g, bsz, T, HV))


def _step(design, T, w, st, tok, slots, accepted, heads, v_blocks=None, rows=None):
    """One speculative step through the kernels (in place on st) and through the reference: (out, want)."""
    H, HV, K, V = heads["H"], heads["HV"], heads["K"], heads["V"]
    bsz = slots.shape[0]
    want = gdn_verify_ref(**tok, **w, conv_state=st["conv_state"], state=st["state"], slots=slots, num_k_heads=H,
                          head_k_dim=K, head_v_dim=V, accepted=accepted)
    scratch = spec_scratch(design, rows or bsz, T, H, K, HV, V, device=DEV)
    out = torch.full((bsz, T, HV * V), float("nan"), device=DEV)
    gdn_verify(**tok, **w, **st, slots=slots, scratch=scratch, num_k_heads=H, head_k_dim=K, head_v_dim=V, out=out,
               v_blocks=v_blocks)
    gdn_commit(scratch, st["conv_state"], st["state"], slots, accepted, H, K, V, v_blocks=v_blocks)
    return out, want


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("design", DESIGNS)
def test_verify_and_commit_equal_sequential_decodes(design, T):
    """B = 3 rows at slots 3, 0, 4 of 5, accepted lengths T, 1 and one between. Outputs of every position and
    the committed states within float32 rounding of the float64 reference, the conv state exact, slots 1 and 2
    untouched. (Steps in a row: test_pending_step_committed_by_the_next_verify.)"""
    heads = SMALL
    w = _weights(**heads, seed=T)
    st = _states(5, **heads, seed=10 + T)
    st0 = {k: v.clone() for k, v in st.items()}
    slots = torch.tensor([3, 0, 4], dtype=torch.int32, device=DEV)
    lengths = [T, 1, (T + 1) // 2]
    accepted = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    out, (out_ref, cs_ref, st_ref) = _step(design, T, w, st, _tokens(3, T, **heads, seed=100 * T), slots, accepted,
                                           heads)
    assert rel(out, out_ref) <= 1e-5
    assert rel(st["state"], st_ref) <= 1e-5
    assert torch.equal(st["conv_state"], cs_ref)
    for s in (1, 2):
        assert torch.equal(st["state"][s], st0["state"][s]) and torch.equal(st["conv_state"][s], st0["conv_state"][s])


@pytest.mark.parametrize("design", DESIGNS)
def test_padding_rows_v_blocks_and_a_larger_scratch(design):
    """Two V-blocks per value head (the o rows meet through the per-(row, value head) ticket), a padding row
    (slot -1: zeros out, nothing touched), a scratch made for more rows than the step has (a CUDA-graph bucket
    using the largest bucket's scratch)."""
    heads = dict(H=1, HV=2, K=16, V=32)
    T = 3
    w = _weights(**heads, seed=5)
    st = _states(4, **heads, seed=6)
    st0 = {k: v.clone() for k, v in st.items()}
    slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEV)
    accepted = torch.tensor([2, 3, 3], dtype=torch.int32, device=DEV)
    tok = _tokens(3, T, **heads, seed=7)
    out, (out_ref, cs_ref, st_ref) = _step(design, T, w, st, tok, slots, accepted, heads, v_blocks=2, rows=6)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel(out, out_ref) <= 1e-5 and rel(st["state"], st_ref) <= 1e-5
    assert torch.equal(st["conv_state"], cs_ref)
    for s in (1, 3):
        assert torch.equal(st["state"][s], st0["state"][s]) and torch.equal(st["conv_state"][s], st0["conv_state"][s])


def test_verify_equals_gdn_decode_kernel_steps_and_the_designs_agree():
    """The verify's outputs are gdn_decode's, launched once per token on copies of the states; design "states"
    leaves gdn_decode's state after all T tokens. Both designs commit the same state: "replay" recomputes, from
    the kept step inputs, the very states "states" kept (bit for bit in the interpreter, where the two run the
    same float32 operations in the same order)."""
    heads = SMALL
    H, HV, K, V = heads["H"], heads["HV"], heads["K"], heads["V"]
    T = 3
    w = _weights(**heads, seed=21)
    st = _states(4, **heads, seed=22)
    slots = torch.tensor([1, 3], dtype=torch.int32, device=DEV)
    tok = _tokens(2, T, **heads, seed=23)
    dec = {k: v.clone() for k, v in st.items()}
    outs = [gdn_decode(tok["qkv"][:, t], tok["z"][:, t], tok["a"][:, t], tok["b"][:, t], **dec, **w, slots=slots,
                       num_k_heads=H, head_k_dim=K, head_v_dim=V, out=torch.empty(2, HV * V, device=DEV))
            for t in range(T)]
    got = {}
    for design in DESIGNS:
        s = {k: v.clone() for k, v in st.items()}
        scratch = spec_scratch(design, 2, T, H, K, HV, V, device=DEV)
        out = gdn_verify(**tok, **w, **s, slots=slots, scratch=scratch, num_k_heads=H, head_k_dim=K, head_v_dim=V,
                         out=torch.full((2, T, HV * V), float("nan"), device=DEV))
        assert rel(out, torch.stack(outs, 1)) <= 1e-5
        if design == "states":
            assert rel(s["state"], dec["state"]) <= 1e-5  # the verify leaves the state after all T tokens
        gdn_commit(scratch, s["conv_state"], s["state"], slots, torch.tensor([2, 1], dtype=torch.int32, device=DEV),
                   H, K, V)
        got[design] = s["state"]
    if DEV == "cpu":
        assert torch.equal(got["states"], got["replay"])
    else:
        assert rel(got["replay"], got["states"]) <= 1e-6


def test_pending_step_committed_by_the_next_verify():
    """Design "replay" with the commit folded into the next verify: step 1 is verified and left pending, step 2's
    verify (rows reordered, one slot new to it with nothing pending) commits step 1 in its pass over the state,
    then verifies. After it the slots hold step 1's committed states; step 2's outputs and, after its own commit,
    the states are the reference's for the two steps in a row."""
    heads = SMALL
    H, HV, K, V = heads["H"], heads["HV"], heads["K"], heads["V"]
    T = 3
    w = _weights(**heads, seed=31)
    st = _states(5, **heads, seed=32)
    slots1 = torch.tensor([3, 0, 4], dtype=torch.int32, device=DEV)
    acc1 = torch.tensor([2, 3, 1], dtype=torch.int32, device=DEV)
    tok1 = _tokens(3, T, **heads, seed=33)
    _, cs1, st1 = gdn_verify_ref(**tok1, **w, **st, slots=slots1, num_k_heads=H, head_k_dim=K, head_v_dim=V,
                                 accepted=acc1)
    slots2 = torch.tensor([0, 4, 1, 3], dtype=torch.int32, device=DEV)
    prev_rows = torch.tensor([1, 2, -1, 0], dtype=torch.int32, device=DEV)  # each slot's row in step 1
    acc2 = torch.tensor([1, 3, 2, 2], dtype=torch.int32, device=DEV)
    tok2 = _tokens(4, T, **heads, seed=34)
    out_ref, cs2, st2 = gdn_verify_ref(**tok2, **w, conv_state=cs1, state=st1, slots=slots2, num_k_heads=H,
                                       head_k_dim=K, head_v_dim=V, accepted=acc2)
    first, second = (spec_scratch("replay", 4, T, H, K, HV, V, device=DEV) for _ in range(2))
    gdn_verify(**tok1, **w, **st, slots=slots1, scratch=first, num_k_heads=H, head_k_dim=K, head_v_dim=V)
    out = gdn_verify(**tok2, **w, **st, slots=slots2, scratch=second, num_k_heads=H, head_k_dim=K, head_v_dim=V,
                     pending=Pending(first, prev_rows, acc1), out=torch.full((4, T, HV * V), float("nan"), device=DEV))
    assert torch.equal(st["conv_state"], cs1) and rel(st["state"], st1) <= 1e-5
    assert rel(out, out_ref) <= 1e-5
    gdn_commit(second, st["conv_state"], st["state"], slots2, acc2, H, K, V)
    assert torch.equal(st["conv_state"], cs2) and rel(st["state"], st2) <= 1e-5
    with pytest.raises(ValueError, match="own scratch"):
        gdn_verify(**tok2, **w, **st, slots=slots2, scratch=second, num_k_heads=H, head_k_dim=K, head_v_dim=V,
                   pending=Pending(second, prev_rows, acc1))


def test_scratch_must_fit():
    heads = SMALL
    H, HV, K, V = heads["H"], heads["HV"], heads["K"], heads["V"]
    w = _weights(**heads, seed=1)
    st = _states(3, **heads, seed=2)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="tokens"):
        gdn_verify(**_tokens(2, 3, **heads, seed=3), **w, **st, slots=slots,
                   scratch=spec_scratch("replay", 2, 4, H, K, HV, V, device=DEV), num_k_heads=H, head_k_dim=K,
                   head_v_dim=V)
    with pytest.raises(ValueError, match="rows"):
        gdn_verify(**_tokens(2, 3, **heads, seed=3), **w, **st, slots=slots,
                   scratch=spec_scratch("states", 1, 3, H, K, HV, V, device=DEV), num_k_heads=H, head_k_dim=K,
                   head_v_dim=V)
    with pytest.raises(ValueError, match="design"):
        spec_scratch("copy", 2, 3, H, K, HV, V, device=DEV)


def test_benchmark_timing_path_dry_run(load_benchmark, monkeypatch):
    """bench_gdn_verify's own path at a small shape, each call run once by a stand-in timer: the checks against
    the float64 reference (ours, the fused variant over two steps, the serving-stack glue with a plain torch
    recurrence standing in for fla-core), the variants timed alone and together, the tile sweep, the table —
    what the GPU run does, minus the GPU."""
    bench = load_benchmark("kernels_gdn_verify")
    monkeypatch.setattr(bench, "VERIFY_SWEEP", ((2, 2),))
    monkeypatch.setattr(bench, "COMMIT_SWEEP", ((1, 2),))
    lines = []
    rows = bench.bench_gdn_verify(1e12, lines.append, batches=(2,), ks=(1,), sweep_k=1,
                                  shape=dict(H=1, HV=2, K=16, V=16, kw=4, eps=1e-6), device=DEV,
                                  timer=lambda calls: [f() for f in calls] and 1.0, copies=1,
                                  rules={"glue": bench.torch_rule})
    (row,) = rows
    assert row["states"]["us"] == row["replay"]["us"] == 2.0 and row["fused"]["us"] == 1.0
    assert row["speedup_replay"] == 0.5 and row["speedup_fused"] == 1.0
    assert row["replay"]["sweep_us"] and row["fused"]["sweep_us"]
    assert {r["impl"] for r in row["checks"]} == {"ours_states", "ours_replay", "ours_fused", "glue"}
