"""benchmarks/bench_kernels.py's floor kernel (kernels_floor.py): stream_read xors exactly the words it
claims to read (so its timings are of a real, complete read), and its configurations cover the bytes
asked; the batch-1 tiles its `--only m1` sweep times (kernels_gemv.py) each compute the GEMV."""

import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need a GPU or TRITON_INTERPRET=1")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("programs,iters,block", [(5, 1, 128), (3, 3, 256), (2, 6, 512)])
def test_stream_read_xors_every_word_it_reads(programs, iters, block, load_benchmark):
    bk = load_benchmark("kernels_floor")
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


def test_stream_read_folds_in_the_activations_it_reads(load_benchmark):
    """With x, every program's word also holds the xor of x's words (independent numpy reduction),
    and flipping one bit of x flips it in every program's word: the read cannot be skipped."""
    bk = load_benchmark("kernels_floor")
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


def test_stream_read_refuses_to_read_past_its_source(load_benchmark):
    bk = load_benchmark("kernels_floor")
    src = torch.zeros(1000, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="past a source"):
        bk.stream_read(src, torch.empty(2, dtype=torch.int32, device=DEV), 1, 512)


def test_stream_configs_read_nearly_all_and_never_past_the_bytes(load_benchmark):
    bk = load_benchmark("kernels_floor")
    for words in (2560 * 4096 // 4, 2560 * 9216 // 8, 18432 * 2560 // 4 + 18432 // 2):
        cfgs = bk.stream_configs(words, 132)
        assert cfgs
        for c in cfgs:
            read = c["programs"] * c["iters"] * c["block"]
            assert 0.97 * words <= read <= words and c["programs"] >= 66


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("n,k", [(2560, 4096), (2560, 9216), (12288, 2560)])
def test_m1_tile_sweep_candidates_compute_the_product(fmt, n, k, load_benchmark):
    """Every batch-1 tile `--only m1` sweeps on an N = 2560 shape or a K = 2560 input projection (the
    tile table's rule first, then only tiles whose block_k divides K) computes the GEMV, on a few rows at the
    shape's full K: a timing in that sweep is always of a correct kernel."""
    from ocriaquant.quant import fp8, nvfp4
    from ocriaquant.runtime.kernels.gemv_fp8 import gemv_fp8, quant_fp8_per_token
    from ocriaquant.runtime.kernels.gemv_nvfp4 import gemv_nvfp4, nvfp4_x_pairs, pack_m1
    from ocriaquant.runtime.kernels.reference import gemv_fp8_ref, gemv_nvfp4_ref
    from ocriaquant.runtime.tiles import TileTable

    bk = load_benchmark("kernels_gemv")
    tiles = TileTable.default()
    cands = bk.m1_candidates(fmt, n, k, tiles)
    assert cands[0] == tiles.tile(fmt, n, k) and len(cands) > 1
    assert all(k % c["block_k"] == 0 for c in cands)
    assert not bk.m1_candidates(fmt, 248320, 2560, tiles)[1:]  # the lm_head: the rule alone
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
