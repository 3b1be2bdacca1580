"""scripts/bench_kernels.py's floor kernel: stream_read xors exactly the words it claims to read
(so its timings are of a real, complete read), and its configurations cover the bytes asked."""

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need a GPU or TRITON_INTERPRET=1")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _bench_kernels():
    spec = importlib.util.spec_from_file_location("bench_kernels",
                                                  Path(__file__).parents[1] / "scripts" / "bench_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("programs,iters,block", [(5, 1, 128), (3, 3, 256), (2, 6, 512)])
def test_stream_read_xors_every_word_it_reads(programs, iters, block):
    bk = _bench_kernels()
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


def test_stream_read_folds_in_the_activations_it_reads():
    """With x, every program's word also holds the xor of x's words (independent numpy reduction),
    and flipping one bit of x flips it in every program's word: the read cannot be skipped."""
    bk = _bench_kernels()
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


def test_stream_read_refuses_to_read_past_its_source():
    bk = _bench_kernels()
    src = torch.zeros(1000, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="past a source"):
        bk.stream_read(src, torch.empty(2, dtype=torch.int32, device=DEV), 1, 512)


def test_stream_configs_read_nearly_all_and_never_past_the_bytes():
    bk = _bench_kernels()
    for words in (2560 * 4096 // 4, 2560 * 9216 // 8, 18432 * 2560 // 4 + 18432 // 2):
        cfgs = bk.stream_configs(words, 132)
        assert cfgs
        for c in cfgs:
            read = c["programs"] * c["iters"] * c["block"]
            assert 0.97 * words <= read <= words and c["programs"] >= 66
