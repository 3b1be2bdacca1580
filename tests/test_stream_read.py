"""scripts/bench_kernels.py's floor kernel: stream_read xors exactly the words it claims to read
(so its timings are of a real, complete read), and its configurations cover the bytes asked."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need a GPU or TRITON_INTERPRET=1")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("programs,iters,block", [(5, 1, 128), (3, 3, 256), (2, 6, 512)])
def test_stream_read_xors_every_word_it_reads(programs, iters, block, load_script):
    bk = load_script("bench_kernels")
    g = torch.Generator().manual_seed(programs * 100 + iters)
    src = torch.randint(-2**31, 2**31 - 1, (programs * iters * block + 77,), dtype=torch.int32, generator=g).to(DEV)
    out = torch.full((programs,), -1, dtype=torch.int32, device=DEV)
    read = bk.stream_read(src, out, iters, block, num_warps=1)
    assert read == programs * iters * block
    # an independent reduction: numpy's xor over each program's contiguous words
    expect = np.bitwise_xor.reduce(src[:read].cpu().numpy().reshape(programs, -1), axis=1)
    assert np.array_equal(bk.stream_read_ref(src, programs, iters, block).cpu().numpy(), expect)
    assert np.array_equal(out.cpu().numpy(), expect)
    src[(programs - 1) * iters * block] ^= 1  # one word of the last program's first block
    bk.stream_read(src, out, iters, block, num_warps=1)
    assert int(out[-1]) == int(expect[-1]) ^ 1 and np.array_equal(out[:-1].cpu().numpy(), expect[:-1])


def test_stream_read_folds_in_the_activations_it_reads(load_script):
    """With x, every program's word also holds the xor of x's words (independent numpy reduction),
    and flipping one bit of x flips it in every program's word: the read cannot be skipped."""
    bk = load_script("bench_kernels")
    g = torch.Generator().manual_seed(7)
    src = torch.randint(-2**31, 2**31 - 1, (3 * 2 * 256,), dtype=torch.int32, generator=g).to(DEV)
    x = torch.randint(-2**31, 2**31 - 1, (64,), dtype=torch.int32, generator=g).to(DEV)
    out = torch.empty(3, dtype=torch.int32, device=DEV)
    bk.stream_read(src, out, 2, 256, num_warps=1, x=x)
    expect = np.bitwise_xor.reduce(src.cpu().numpy().reshape(3, -1), axis=1) ^ np.bitwise_xor.reduce(x.cpu().numpy())
    assert np.array_equal(out.cpu().numpy(), expect)
    assert np.array_equal(bk.stream_read_ref(src, 3, 2, 256, x).cpu().numpy(), expect)
    x[5] ^= 1 << 9
    bk.stream_read(src, out, 2, 256, num_warps=1, x=x)
    assert np.array_equal(out.cpu().numpy(), expect ^ (1 << 9))
    with pytest.raises(ValueError, match="power of two"):
        bk.stream_read(src, out, 2, 256, x=x[:60])


def test_stream_read_refuses_to_read_past_its_source(load_script):
    bk = load_script("bench_kernels")
    src = torch.zeros(1000, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="past a source"):
        bk.stream_read(src, torch.empty(2, dtype=torch.int32, device=DEV), 1, 512)


def test_stream_configs_read_nearly_all_and_never_past_the_bytes(load_script):
    bk = load_script("bench_kernels")
    for words in (2560 * 4096 // 4, 2560 * 9216 // 8, 18432 * 2560 // 4 + 18432 // 2):
        cfgs = bk.stream_configs(words, 132)
        assert cfgs
        for c in cfgs:
            read = c["programs"] * c["iters"] * c["block"]
            assert 0.97 * words <= read <= words and c["programs"] >= 66


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("n,k", [(2560, 4096), (2560, 9216), (12288, 2560)])
def test_m1_tile_sweep_candidates_compute_the_product(fmt, n, k, load_script):
    """Every batch-1 tile `--only m1` sweeps on an N = 2560 shape or a K = 2560 input projection (the
    rule first, then only tiles whose block_k divides K) computes the GEMV, on a few rows at the
    shape's full K: a timing in that sweep is always of a correct kernel."""
    from ocriaquant.quant import fp8, nvfp4
    from ocriaquant.runtime.kernels import gemv_fp8, gemv_fp8_ref, gemv_nvfp4, gemv_nvfp4_ref, quant_fp8_per_token
    from ocriaquant.runtime.kernels.gemv_nvfp4 import nvfp4_x_pairs, pack_m1
    from ocriaquant.runtime.kernels.tiles import m1_tile

    bk = load_script("bench_kernels")
    cands = bk.m1_candidates(fmt, n, k)
    assert cands[0] == m1_tile(fmt, n, k) and len(cands) > 1
    assert all(k % c["block_k"] == 0 for c in cands)
    assert not bk.m1_candidates(fmt, 248320, 2560)[1:]  # the lm_head: the rule alone
    torch.manual_seed(k)
    rows = 24  # ragged against every block_n above 8
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    w = torch.randn(rows, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    if fmt == "fp8":
        (w_q, w_s), (x_q, x_s, half) = fp8.quantize_weight(w), quant_fp8_per_token(x, half=True)
        ref = gemv_fp8_ref(x_q, x_s, w_q, w_s)
        run = lambda out, c: gemv_fp8(x_q, x_s, w_q, w_s, out=out, x_half=half, **c)  # noqa: E731
    else:
        packed, scales, gs = nvfp4.quantize_weight(w)
        ref, m1, pairs = gemv_nvfp4_ref(x, packed, scales, gs), pack_m1(packed, scales), nvfp4_x_pairs(x)
        run = lambda out, c: gemv_nvfp4(None, packed, scales, gs, out=out, x_pairs=pairs, m1=m1, **c)  # noqa: E731
    for c in cands:
        out = run(torch.full((1, rows), float("nan"), dtype=torch.bfloat16, device=DEV), c)
        assert torch.isfinite(out).all(), c
        assert ((out.double() - ref.double()).norm() / ref.double().norm()).item() <= 1e-2, c


@pytest.mark.parametrize("form", [dict(wtma=0), dict(wtma=1), dict(tiled=1), dict(tiled=1, wtma=1), dict(pre_k=256),
                                  dict(split_k=2, wtma=1), dict(split_k=3, pre_k=256)])
def test_probe_dot_forms_compute_the_product(form, monkeypatch):
    """Each form scripts/probe_dot_forms.py times (TMA loads, the tiled weight, loads before the wait, split-K)
    computes the FP8 GEMV of its reference at a small shape: a timing in that probe is of a correct kernel."""
    import importlib

    from ocriaquant.quant import fp8
    from ocriaquant.runtime.kernels import gemv_fp8_ref, quant_fp8_per_token

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))  # the probe imports bench_kernels
    probe = importlib.import_module("probe_dot_forms")
    torch.manual_seed(1)
    n, k, m = 128, 1024, 8
    w_q, w_s = fp8.quantize_weight(torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5)
    x_q, x_s = quant_fp8_per_token(torch.randn(m, k, dtype=torch.bfloat16, device=DEV))
    c = dict(block_n=64, block_k=128, num_stages=2, **form)
    src = probe.tiled_weight(w_q, 64, 128) if c.get("tiled") else w_q
    out = probe.probe_gemv(x_q, x_s, w_q, w_s, torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV),
                           src, **c)
    ref = gemv_fp8_ref(x_q, x_s, w_q, w_s)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 1e-2


def _probe_mma(monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))  # the probe imports bench_kernels
    return importlib.import_module("probe_mma_gemv")


def test_probe_mma_packing_meets_the_mma_fragments(monkeypatch):
    """scripts/probe_mma_gemv.py's pack_fp8 gives each lane the A fragments of its two m16n8k16 MMAs a K-step in
    the K order the activation words use: multiplying the fragments as the PTX ISA lays them out (lane 4g + t:
    A (row g / g+8, K slots 2t, 2t+1 | 2t+8, 2t+9), B (the same slots, column g)), written here from that
    layout alone, gives W · xᵀ. The kernel itself runs only on a GPU (test_probe_mma_gemv_computes_the_product)."""
    probe = _probe_mma(monkeypatch)
    torch.manual_seed(0)
    n, k, m = 32, 96, 8
    w = torch.randn(n, k).to(torch.float8_e4m3fn)
    x = torch.randn(m, k).to(torch.float8_e4m3fn)
    words = probe.pack_fp8(w)
    assert words.shape == (n // 16, k // 32, 32, 4) and words.dtype == torch.int32

    def e4m3(b):  # uint8 codes -> values
        return b.contiguous().view(torch.float8_e4m3fn).double()

    got = torch.zeros(n, m, dtype=torch.float64)
    xb = x.view(torch.uint8)
    for rg in range(n // 16):
        for ks in range(k // 32):
            for j in range(2):  # the K-step's two MMAs: words (2j, 2j + 1), activations at k + 16j
                a = torch.zeros(16, 16, dtype=torch.float64)
                b = torch.zeros(16, 8, dtype=torch.float64)
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    by = words[rg, ks, lane].contiguous().view(torch.uint8)
                    for h, word in ((0, 2 * j), (8, 2 * j + 1)):  # rows g, g + 8
                        v = e4m3(by[4 * word:4 * word + 4])
                        a[g + h, 2 * t:2 * t + 2], a[g + h, 2 * t + 8:2 * t + 10] = v[:2], v[2:]
                    k0 = 32 * ks + 16 * j + 4 * t
                    v = e4m3(xb[g, k0:k0 + 4])
                    b[2 * t:2 * t + 2, g], b[2 * t + 8:2 * t + 10, g] = v[:2], v[2:]
                got[16 * rg:16 * rg + 16] += a @ b
    assert torch.equal(got, w.double() @ x.double().T)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX (mma.sync): GPU only")
@pytest.mark.parametrize("m,cfg", [(1, dict(rows=1, unroll=4, num_warps=2, split_k=1)),
                                   (1, dict(rows=2, unroll=4, num_warps=4, split_k=2)),
                                   (8, dict(rows=1, unroll=8, num_warps=2, split_k=2)),
                                   (13, dict(rows=2, unroll=4, num_warps=2, split_k=1))])
def test_probe_mma_gemv_computes_the_product(m, cfg, monkeypatch):
    """The probe's FP8 GEMV on warp MMAs (codes, and at M = 1 the fp16 activation form) against float64, on a
    NaN-poisoned output, split and unsplit, M past one token tile: a timing in that probe is of a correct kernel."""
    from ocriaquant.quant import fp8
    from ocriaquant.runtime.kernels import gemv_fp8_ref, quant_fp8_per_token

    probe = _probe_mma(monkeypatch)
    torch.manual_seed(m)
    n, k = 64, 1024
    w_q, w_s = fp8.quantize_weight(torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5)
    x_q, x_s, x_h = quant_fp8_per_token(torch.randn(m, k, dtype=torch.bfloat16, device="cuda"), half=True)
    ref = gemv_fp8_ref(x_q, x_s, w_q, w_s)
    for half in ((None, x_h) if m == 1 else (None,)):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        probe.gemv_fp8_mma(x_q, x_s, probe.pack_fp8(w_q), w_s.float(), out=out, x_half=half, **cfg)
        assert torch.isfinite(out).all()
        assert ((out.double() - ref).norm() / ref.norm()).item() <= 1e-2
