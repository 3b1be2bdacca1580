"""scripts/probe_persistent.py's chain: each variant whose timings the probe reports computes the chain
exactly (so what is timed is the full, dependent work), against an int64 reference that numpy recomputes
independently; a changed weight word shows in every phase after it. Under the interpreter the CTAs of a
launch run one after another, so the persistent kernel's grid barrier is exercised with one CTA."""

import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need a GPU or TRITON_INTERPRET=1")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _numpy_chain(chain):
    """Each phase's output, from the weights and x0 alone: wrapping uint32 sums of xors."""
    w = chain.w.cpu().numpy().view(np.uint32)
    x, outs = chain.x0.cpu().numpy().view(np.uint32), []
    for p, (n, kw) in enumerate(chain.rows):
        off = chain.tab_host[p][0]
        y = (w[off:off + n * kw].reshape(n, kw) ^ x[np.arange(kw) % x.size][None, :]).sum(1, dtype=np.uint32)
        outs.append(y.view(np.int32))
        x = y
    return outs


@pytest.mark.parametrize("variant,grid", [("launches", 3), ("launches", 1), ("persistent", 1), ("flags", 1),
                                          ("dataflow", 1), ("dataflow-all", 1)])
def test_chain_variants_compute_every_phase(variant, grid, load_script):
    probe = load_script("probe_persistent")
    chain = probe.Chain(probe.tiny_phases(), DEV, grid, 8, 16)
    expect = _numpy_chain(chain)
    assert all(np.array_equal(r.cpu().numpy().astype(np.int32), e) for r, e in zip(chain.reference(), expect))
    assert probe.check(chain, variant, grid, 1) == 0
    dataflow = variant.startswith("dataflow")
    for p in range(1, len(expect)):  # phase 0's output is zeroed by the last phase, for the next pass
        assert np.array_equal(chain.output(p, dataflow).cpu().numpy(), expect[p])
    if variant in ("persistent", "flags"):
        assert int(chain.bar.abs().sum()) == 0 and int(chain.flags.abs().sum()) == 0  # reset for the next launch
    if dataflow:  # every row block of every phase counted all its split-K units
        for p, row in enumerate(chain.tab_host):
            nb = -(-row[1] // chain.bn)
            assert chain.cnt[row[8]:row[8] + nb].tolist() == [row[3]] * nb
    chain.w[chain.tab_host[1][0] + 3] ^= 1  # one word of phase 1's first row
    chain.reset()
    probe.launch(chain, variant, grid, 1)
    assert chain.output(1)[0] != int(expect[1][0]) and np.array_equal(chain.output(1)[1:].cpu().numpy(),
                                                                       expect[1][1:])
    assert all((chain.output(p, dataflow).cpu().numpy() != expect[p]).any() for p in range(2, len(expect)))


def test_step_phases_follow_the_4b_shape(load_script):
    probe = load_script("probe_persistent")
    phases = probe.step_phases("qwen3.5-4b", 512, lm_head=True)
    names = [name for name, _, _ in phases]
    assert names.count("gdn_decode") == 24 and names.count("attn_chunk") == 8 and names[-1] == "lm_head_bf16"
    assert names.count("down_nvfp4") == 32 and names.count("norm") == 65
    by_name = {name: (n, b) for name, n, b in phases}
    assert by_name["gate_up_nvfp4"] == (2 * 9216, 2560 // 2 + 2560 // 16)
    assert by_name["gdn_in_fp8"] == (2 * 2048 + 2 * 4096 + 64, 2564)
    assert by_name["gdn_decode"][0] * by_name["gdn_decode"][1] == 2 * 32 * 128 * 128 * 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs CTAs that run one after another (the interpreter)")
@pytest.mark.parametrize("variant", ["persistent", "flags", "dataflow"])
def test_barrier_over_a_grid_not_resident_gives_up_rather_than_hangs(variant, load_script):
    probe = load_script("probe_persistent")
    chain = probe.Chain(probe.tiny_phases(), DEV, 2, 8, 16)
    # the interpreter runs CTA 0 to its end before CTA 1 starts: CTA 0's first wait on CTA 1 can never end
    assert probe.check(chain, variant, 2, 1, spin_limit=4) == -1
    assert int(chain.bar.abs().sum()) == 0 and int(chain.flags.abs().sum()) == 0  # cleared for the next try
