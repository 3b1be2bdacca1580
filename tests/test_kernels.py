"""Every Triton kernel against its reference on fresh random inputs. On the CPU this runs under
TRITON_INTERPRET=1 at small shapes (the README's test command sets it); benchmarks/bench_kernels.py
runs the same checks at Qwen3.5-4B shapes on the GPU. The references are kernels/reference.py's,
whose quantized formats are checked against ocriaquant.quant here too."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
pytest.importorskip("triton")

from ocriaquant.quant import fp8, nvfp4  # noqa: E402
from ocriaquant.runtime.kernels import gemv_fp8 as gemv_fp8_module  # noqa: E402
from ocriaquant.runtime.kernels import reference  # noqa: E402
from ocriaquant.runtime.kernels.add_rmsnorm import add_rmsnorm  # noqa: E402
from ocriaquant.runtime.kernels.attn_decode import attn_decode  # noqa: E402
from ocriaquant.runtime.kernels.conv_silu import conv_silu  # noqa: E402
from ocriaquant.runtime.kernels.gated_rmsnorm import gated_rmsnorm  # noqa: E402
from ocriaquant.runtime.kernels.gdn_decode import gdn_decode  # noqa: E402
from ocriaquant.runtime.kernels.gemv_bf16 import gemv_bf16  # noqa: E402
from ocriaquant.runtime.kernels.gemv_dot import gemv_dot  # noqa: E402
from ocriaquant.runtime.kernels.gemv_fp8 import gemv_fp8, gemv_fp8_quantizing, quant_fp8_per_token  # noqa: E402
from ocriaquant.runtime.kernels.gemv_nvfp4 import (gemv_nvfp4, gemv_nvfp4_silu, nvfp4_x_pairs, pack_m1,  # noqa: E402
                                                   pure_loads)
from ocriaquant.runtime.kernels.greedy_advance import greedy_advance  # noqa: E402
from ocriaquant.runtime.kernels.partials import Partials  # noqa: E402
from ocriaquant.runtime.kernels.qk_norm_rope import qk_norm_rope  # noqa: E402
from ocriaquant.runtime.kernels.reference import (add_rmsnorm_ref, attn_decode_ref, gdn_decode_ref,  # noqa: E402
                                                  gemv_bf16_ref, gemv_fp8_ref, gemv_nvfp4_ref, gemv_nvfp4_silu_ref,
                                                  greedy_advance_ref, nvfp4_x_pairs_ref, qk_norm_rope_ref,
                                                  silu_mul_quant_ref, step_inputs_ref)
from ocriaquant.runtime.kernels.silu_mul_quant import silu_mul_quant  # noqa: E402
from ocriaquant.runtime.kernels.splitk import l2_ahead, use_pdl  # noqa: E402
from ocriaquant.runtime.kernels.step_inputs import step_inputs  # noqa: E402
from ocriaquant.runtime.kernels.vision_rope import vision_rope  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def poisoned(m, n, dtype=torch.bfloat16):
    return torch.full((m, n), float("nan"), dtype=dtype, device=DEV)


def fp8_codes_match(got, want):
    """E4M3 codes equal. The interpreter flushes E4M3 subnormals differently from the GPU's
    cvt (seen with Triton 3.x on the CPU), so there a subnormal may be one step off."""
    g, w = got.float(), want.float()
    if DEV == "cuda":
        return torch.equal(g, w)
    normal = w.abs() >= 2.0**-6
    return torch.equal(g[normal], w[normal]) and bool(((g - w).abs() <= 2.0**-9 + 1e-12).all())


_LEAF_IMPORTS = r"""
import importlib.abc, sys
import torch  # before the finder: torch may probe for triton itself

class NoTriton(importlib.abc.MetaPathFinder):  # as if triton were not installed
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTriton())
import ocriaquant.runtime.kernels
import ocriaquant.runtime.kernels.partials
import ocriaquant.runtime.kernels.reference
ours = sorted(m for m in sys.modules if m.startswith("ocriaquant"))
print(" ".join(ours))
"""


def test_reference_partials_and_the_package_import_no_triton_nor_our_other_code():
    """The torch backend imports kernels/reference.py and kernels/partials.py where Triton is not installed, and
    kernels/ imports nothing of ours outside it: in a process where importing triton fails, the package and
    those two modules import, and pull in no module of ours outside kernels/."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _LEAF_IMPORTS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = proc.stdout.split()
    assert "ocriaquant.runtime.kernels.reference" in ours
    assert [m for m in ours if not m.startswith("ocriaquant.runtime.kernels")] == ["ocriaquant", "ocriaquant.runtime"]


def test_reference_quant_formats_equal_ocriaquant_quant():
    """reference.py writes out the FP8 per-token and NVFP4 numerics it needs (kernels/ imports nothing of ours
    outside it); bit for bit they are ocriaquant.quant's, on random values over many decades, zero rows and
    blocks, -0, values on the E2M1 grid's ties and past its saturation, in bf16, fp16 and fp32."""
    torch.manual_seed(5)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(6, 512) * torch.logspace(-4, 4, 512)
        x[0] = 0
        x[1, :32] = -0.0
        x[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, -0.25, -0.75, -2.5, -5.0, -0.1,
                                  1e-3, -6.5]) * 0.5  # a block whose absmax is 3.5: scale 7/12 · global
        x[3, :16] = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
                                  -5.0, 6.0])  # absmax 6: the values are their own E2M1 multiples of the scale
        x = x.to(dtype).to(DEV)
        q, s = reference.fp8_quantize_per_token(x)
        q_want, s_want = fp8.quantize_activation(x)
        assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8)) and torch.equal(s, s_want), dtype
        assert s.dtype == s_want.dtype == dtype
        assert torch.equal(reference.fp8_fake_quant_per_token(x), fp8.fake_quant_activation(x))
        for gs in (nvfp4.global_scale(x), nvfp4.global_scale(x) * 0.01):  # * 0.01: small block scales, zeros
            packed, scales = reference.nvfp4_quantize(x, gs)
            p_want, s_want, _ = nvfp4.quantize_weight(x, gs)
            assert torch.equal(packed, p_want) and torch.equal(scales.view(torch.uint8), s_want.view(torch.uint8))
            for out in (torch.bfloat16, torch.float32):
                assert torch.equal(reference.nvfp4_dequantize(packed, scales, gs, out),
                                   nvfp4.dequantize(p_want, s_want, gs, out))
            fq = reference.nvfp4_fake_quant(x, gs)
            assert torch.equal(fq, nvfp4.fake_quant_activation(x, gs)) and fq.dtype == dtype
            assert torch.equal(fq, nvfp4.fake_quant_weight(x, gs))


@pytest.mark.parametrize("m,k", [(1, 4096), (3, 1000), (1, 5000)])
def test_quant_fp8_per_token_slices(m, k):
    """Activation quantization equals quant/'s (compressed-tensors-exact) numerics however the
    row is shared out among programs (each reads it whole for the scale, writes a slice)."""
    torch.manual_seed(k)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV) * 3
    q_ref, s_ref = fp8.quantize_activation(x)
    for slice_k in (None, 128, 512, 8192):  # None: the default (slices at M = 1)
        q, s, h = quant_fp8_per_token(x, half=True, slice_k=slice_k)
        assert torch.equal(s, s_ref.float()) and fp8_codes_match(q, q_ref)
        assert torch.equal(h, q.to(torch.float16) * 2.0**-8)


@pytest.mark.parametrize("m,n,k,split", [(1, 48, 512, None), (1, 40, 768, 2), (1, 40, 640, 2), (5, 40, 768, 1),
                                         (16, 32, 1024, 3), (33, 16, 256, 1)])
def test_gemv_fp8(m, n, k, split):
    torch.manual_seed(m * 1000 + n)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV) * 3
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    w_q, w_s = fp8.quantize_weight(w)
    x_q, x_s = quant_fp8_per_token(x)
    # Activation quantization equals quant/'s (compressed-tensors-exact) numerics.
    q_ref, s_ref = fp8.quantize_activation(x)
    assert torch.equal(x_s, s_ref.float())
    assert fp8_codes_match(x_q, q_ref)
    for _ in range(2):  # the split-K tickets reset themselves: a second call is right too
        out = gemv_fp8(x_q, x_s, w_q, w_s, out=poisoned(m, n), split_k=split)
        assert torch.isfinite(out).all()
        assert rel(out, gemv_fp8_ref(x_q, x_s, w_q, w_s)) <= 1e-2
    if m == 1:  # the paired-fp16 path (half2.py) and the fp32 one differ only by fp16 block sums
        assert rel(gemv_fp8(x_q, x_s, w_q, w_s, path="half2"), gemv_fp8(x_q, x_s, w_q, w_s, path="fma")) <= 4e-3
    with pytest.raises(ValueError, match="M <= 64"):
        gemv_fp8(torch.zeros(65, k, dtype=torch.float8_e4m3fn, device=DEV), torch.ones(65, 1, device=DEV), w_q, w_s)


# The runtime's batch-1 tiles for the 4B's shapes (its tile rules), kind -> {(N, K): tile}.
M1_TILES = {
    "fp8": {(12352, 2560): dict(block_n=64, block_k=512, num_warps=8),
            (2560, 4096): dict(block_n=8, block_k=4096, split_k=1, num_warps=4),
            (2560, 9216): dict(block_n=64, block_k=512, split_k=8, num_warps=8)},
    "fp8_qx": {(2560, 4096): dict(block_n=128, block_k=256, split_k=8, num_warps=8)},
    "nvfp4": {(12352, 2560): dict(block_n=32, block_k=512),
              (2560, 4096): dict(block_n=4, block_k=4096, split_k=1, num_warps=4),
              (2560, 9216): dict(block_n=8, block_k=1024, split_k=3, num_warps=2)},
    "bf16": {(18432, 2560): dict(block_n=4, block_k=512),
             (2560, 4096): dict(block_n=4, block_k=1024, num_warps=8),
             (2560, 9216): dict(block_n=4, block_k=1024, num_warps=8),
             (12352, 2560): dict(block_n=8, block_k=512)},
}
ROWS = 70  # of the shape's N, at its full K: a ragged last row tile at 4, 8, 32, 64 and 128 rows


@pytest.mark.parametrize("n,k", list(M1_TILES["fp8"]))
def test_gemv_fp8_m1_rule_tiles(n, k):
    """The batch-1 tile the runtime gives each of the 4B's FP8 shapes (split K, 8 warps, 64 or 128 rows, or
    narrow rows whole in one K-tile) computes the product, on ROWS of the shape's rows at its full K."""
    torch.manual_seed(n + k)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV) * 3
    w_q, w_s = fp8.quantize_weight(torch.randn(ROWS, k, dtype=torch.bfloat16, device=DEV) / k**0.5)
    x_q, x_s = quant_fp8_per_token(x)
    tile = M1_TILES["fp8"][n, k]
    out = gemv_fp8(x_q, x_s, w_q, w_s, out=poisoned(1, ROWS), path="half2", **tile)
    assert torch.isfinite(out).all()
    assert rel(out, gemv_fp8_ref(x_q, x_s, w_q, w_s)) <= 1e-2
    if (n, k) in M1_TILES["fp8_qx"]:  # out_proj / o_proj quantize their input themselves, from gdn_decode's /
        amax = x.float().abs().amax().reshape(1)  # attention's amax, on a split tile (not every CTA quantizes all K)
        qx_tile = M1_TILES["fp8_qx"][n, k]
        # bit for bit what quantizing first and then running the plain GEMV on the same tile gives
        same_tile = gemv_fp8(x_q, x_s, w_q, w_s, out=poisoned(1, ROWS), path="half2", **qx_tile)
        assert rel(same_tile, gemv_fp8_ref(x_q, x_s, w_q, w_s)) <= 1e-2
        assert torch.equal(gemv_fp8_quantizing(x, amax, w_q, w_s, out=poisoned(1, ROWS), **qx_tile), same_tile)


@pytest.mark.parametrize("n,k", list(M1_TILES["nvfp4"]))
def test_gemv_nvfp4_m1_rule_tiles(n, k):
    """The batch-1 tile the runtime gives each of the 4B's NVFP4 shapes (down_proj: 8 rows on 2 warps, K in
    3 splits) computes the product on ROWS of the shape's rows at its full K, reduced in the kernel and as
    the partials add_rmsnorm sums."""
    torch.manual_seed(n + k + 1)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    packed, scales, gs = nvfp4.quantize_weight(torch.randn(ROWS, k, dtype=torch.bfloat16, device=DEV) / k**0.5)
    ref = gemv_nvfp4_ref(x, packed, scales, gs)
    tile = M1_TILES["nvfp4"][n, k]
    out = gemv_nvfp4(x, packed, scales, gs, out=poisoned(1, ROWS), path="fma", **tile)
    assert torch.isfinite(out).all() and rel(out, ref) <= 1e-2
    if tile.get("split_k", 1) > 1:
        parts = gemv_nvfp4(x, packed, scales, gs, path="fma", partials=True, **tile).parts
        assert parts.shape[0] == tile["split_k"] and rel(parts.double().sum(0), ref) <= 1e-2


@pytest.mark.parametrize("block_n,block_k,warps,split", [(64, 512, 8, 1), (16, 256, 4, 2), (8, 1024, 2, 2)])
def test_gemv_nvfp4_m1_load_forms(block_n, block_k, warps, split):
    """The batch-1 kernel with its activations and block scales read either way (pure_loads: laid out as the
    tile uses them on K-tiles of up to 512, converted into its layout on wider ones and in gemv_nvfp4_silu), on
    tiles of both kinds: against float64, and with one-hot activations exactly the dequantized weight's columns,
    over a zero block and a ragged last row tile."""
    assert pure_loads(block_k, False) == (block_k <= 512) and not pure_loads(block_k, True)
    n, k = 76, 2 * split * block_k  # 76: a ragged last row tile at 8, 16 and 64 rows
    torch.manual_seed(block_k)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    w[3, 16:32] = 0
    packed, scales, gs = nvfp4.quantize_weight(w)
    tile = dict(block_n=block_n, block_k=block_k, num_warps=warps, split_k=split, path="fma")
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    out = gemv_nvfp4(x, packed, scales, gs, out=poisoned(1, n), **tile)
    assert torch.isfinite(out).all() and rel(out, gemv_nvfp4_ref(x, packed, scales, gs)) <= 1e-2
    want = nvfp4.dequantize(packed, scales, gs)
    tile["split_k"] = 1  # reduced in the kernel, whose bf16 cast truncates under the interpreter (rounding.py)
    for j in (0, 17, block_k + 5, k - 1):  # both words and halves of a block, a later K-tile, the last column
        one_hot = torch.zeros(1, k, dtype=torch.bfloat16, device=DEV)
        one_hot[0, j] = 1
        assert torch.equal(gemv_nvfp4(one_hot, packed, scales, gs, **tile)[0], want[:, j]), j


@pytest.mark.parametrize("n,k,split,parts", [(48, 512, None, 1), (40, 768, 2, 3), (40, 640, 2, 16), (64, 1024, 4, 4)])
def test_gemv_fp8_quantizing_equals_quant_then_gemv(n, k, split, parts):
    """Batch 1, the bf16 row quantized inside the GEMV from its absmax in parts: bit for bit the
    output of quant_fp8_per_token then gemv_fp8 (same codes, same sums), whole and split K,
    partial sums too. Twice: each CTA's scratch is rewritten."""
    torch.manual_seed(n + k + parts)
    w_q, w_s = fp8.quantize_weight(torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5)
    for call in range(2):
        x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV) * (3 + call)
        x[0, k // 3] = 40.0 * (call + 1)  # one outlier sets the scale
        cut = torch.linspace(0, k, parts + 1).long().tolist()
        amax = torch.stack([x[0, a:b].float().abs().amax() for a, b in zip(cut, cut[1:])])
        q, s, h = quant_fp8_per_token(x, half=True)
        want = gemv_fp8(q, s, w_q, w_s, x_half=h, split_k=split)
        got = gemv_fp8_quantizing(x, amax, w_q, w_s, out=poisoned(1, n), split_k=split)
        assert torch.equal(got, want), call
        assert rel(got, gemv_fp8_ref(q, s, w_q, w_s)) <= 1e-2
        if split:
            # a clone: partials are views of the workspace the next GEMV of the shape rewrites
            pw = gemv_fp8(q, s, w_q, w_s, x_half=h, split_k=split, partials=True).parts.clone()
            pg = gemv_fp8_quantizing(x, amax, w_q, w_s, split_k=split, partials=True)
            assert torch.equal(pg.parts, pw)
    with pytest.raises(ValueError, match="one contiguous row"):
        gemv_fp8_quantizing(torch.zeros(2, k, dtype=torch.bfloat16, device=DEV), amax, w_q, w_s)


@pytest.mark.parametrize("m,n,k,split", [(1, 48, 512, None), (1, 40, 768, 2), (1, 40, 640, 2), (7, 32, 768, 2),
                                         (20, 16, 1024, 1)])
def test_gemv_nvfp4(m, n, k, split):
    torch.manual_seed(m * 1000 + n + 1)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    w[0, :16] = 0  # a zero block (scale 0.125 in compressed-tensors)
    packed, scales, gs = nvfp4.quantize_weight(w)
    for _ in range(2):
        out = gemv_nvfp4(x, packed, scales, gs, out=poisoned(m, n), split_k=split)
        assert torch.isfinite(out).all()
        assert rel(out, gemv_nvfp4_ref(x, packed, scales, gs)) <= 1e-2
    # The dequantized weight in the kernel is exactly quant.nvfp4's: with one-hot activations the
    # output rows are the weight columns.
    eye = torch.eye(16, k, dtype=torch.bfloat16, device=DEV)
    cols = gemv_nvfp4(eye, packed, scales, gs, split_k=1)
    assert torch.equal(cols, nvfp4.dequantize(packed, scales, gs)[:, :16].T.contiguous())
    # the M = 1 path (word-wise decode, two nibbles per integer op) gives the same columns: all
    # 16 positions of a block, both words and both halves of each word
    col0 = torch.cat([gemv_nvfp4(eye[j:j + 1], packed, scales, gs, split_k=1, path="fma") for j in range(16)])
    assert torch.equal(col0, cols)


@pytest.mark.parametrize("fmt,split", [("fp8", 3), ("nvfp4", 2), ("fp8", 1)])
def test_gemv_partials_feed_add_rmsnorm(fmt, split):
    """A batch-1 GEMV asked for partials returns its K splits unreduced (partials.Partials); summed
    in split order they are its output, and add_rmsnorm adds them up as it reads the residual,
    giving what it gives for that output in bf16, byte for byte. Unsplit, the output is plain."""
    torch.manual_seed(split)
    n, k = 160, 1024
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    if fmt == "fp8":

        x_q, x_s, half = quant_fp8_per_token(x, half=True)
        w_q, w_s = fp8.quantize_weight(w)
        run = lambda p: gemv_fp8(x_q, x_s, w_q, w_s, split_k=split, x_half=half, partials=p)  # noqa: E731
        ref = gemv_fp8_ref(x_q, x_s, w_q, w_s)
    else:
        packed, scales, gs = nvfp4.quantize_weight(w)
        run = lambda p: gemv_nvfp4(x, packed, scales, gs, split_k=split, partials=p)  # noqa: E731
        ref = gemv_nvfp4_ref(x, packed, scales, gs)
    out, parts = run(False), run(True)
    if split == 1:
        assert not isinstance(parts, Partials) and torch.equal(parts, out)
        return
    assert isinstance(parts, Partials) and parts.parts.shape[0] > 1 and parts.parts.shape[1:] == (1, n)
    total = parts.parts[0].clone()
    for p in parts.parts[1:]:
        total += p
    assert rel(total, ref) <= 1e-2
    if DEV == "cuda":  # the interpreter's bf16 cast in the GEMV's own reduction truncates (rounding.py)
        assert torch.equal(total.bfloat16(), out)
    resid = (torch.randn(1, n, device=DEV) * 3).bfloat16()
    nw = (torch.randn(n, device=DEV) * 0.1).bfloat16()
    for quant in (None, "fp8", "nvfp4"):
        for slice_d in (None, 4096):
            got = add_rmsnorm(resid, parts, nw, 1e-6, quant, slice_d=slice_d)
            want = add_rmsnorm(resid, total.bfloat16(), nw, 1e-6, quant, slice_d=slice_d)
            flat = lambda o: [*o[:2], *(o[2] if len(o) > 2 else [])]  # noqa: E731
            assert all(torch.equal(a.view(torch.uint8), c.view(torch.uint8)) for a, c in zip(flat(got), flat(want)))


def nvfp4_pairs_values(words, scales):
    """NVFP4 activation pairs (half2.nvfp4_pairs: x · 2^(14 - e) in fp16, scales 2^e) back to
    values, in K order."""
    m = words.shape[0]
    h = words.contiguous().view(torch.float16).float().reshape(m, -1, 16)
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15], device=words.device)
    vals = torch.empty_like(h)
    vals[..., order] = h
    return (vals * scales[..., None] * 2.0**-14).reshape(m, -1)


@pytest.mark.parametrize("i,k,block_k", [(48, 512, 256), (80, 256, 128)])
def test_gemv_nvfp4_silu_pairs(i, k, block_k):
    """Batch 1: the fused gate_up GEMV whose epilogue writes silu(gate) · up as down_proj's
    activation pairs (pack_m1 interleaves the rows) equals the two-launch path — gemv_nvfp4,
    then silu_mul_quant — bit for bit, and the float64 reference to bf16 rounding."""
    torch.manual_seed(i + k)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    w = torch.randn(2 * i, k, dtype=torch.bfloat16, device=DEV) * 2 / k**0.5
    packed, scales, gs = nvfp4.quantize_weight(w)
    xp = nvfp4_x_pairs(x)
    hw, hs = gemv_nvfp4_silu(xp, pack_m1(packed, scales, interleave=True), gs, block_n=32, block_k=block_k)
    gu = gemv_nvfp4(x, packed, scales, gs, x_pairs=xp, split_k=1, block_n=32, block_k=block_k)
    _, (pw, ps) = silu_mul_quant(gu[:, :i].contiguous(), gu[:, i:].contiguous(), "bf16", pairs=True)
    assert torch.equal(hw, pw) and torch.equal(hs, ps)
    assert rel(nvfp4_pairs_values(hw, hs), gemv_nvfp4_silu_ref(x, packed, scales, gs)) <= 1e-2
    with pytest.raises(ValueError, match="multiple of 32"):
        gemv_nvfp4_silu(xp, pack_m1(packed, scales, interleave=True), gs, block_n=16)
    with pytest.raises(ValueError, match="I a multiple of 16"):
        pack_m1(packed[:40], scales[:40], interleave=True)


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 3e4])
def test_gemv_nvfp4_m1_activation_range(scale):
    """The M = 1 path scales each 16-value block of x into fp16 by a power of two (half2.py):
    tiny, huge and wide-ranging activations neither overflow nor lose the result; all-zero
    activations give zeros."""
    torch.manual_seed(7)
    n, k = 24, 512
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    packed, scales, gs = nvfp4.quantize_weight(w)
    spread = torch.exp(torch.empty(1, k, device=DEV).uniform_(-6, 6))  # values over ~5 decades
    x = (torch.randn(1, k, device=DEV) * spread * scale / spread.max()).to(torch.bfloat16)
    out = gemv_nvfp4(x, packed, scales, gs, out=poisoned(1, n), split_k=2)
    assert torch.isfinite(out).all()
    assert rel(out, gemv_nvfp4_ref(x, packed, scales, gs)) <= 1e-2
    zero = gemv_nvfp4(torch.zeros(1, k, dtype=torch.bfloat16, device=DEV), packed, scales, gs, out=poisoned(1, n))
    assert torch.equal(zero, torch.zeros_like(zero))


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("m,n,k,block_n,block_k,split", [(2, 200, 384, 64, 128, 1), (8, 130, 640, 64, 128, 3),
                                                         (5, 96, 600, 32, 128, 2), (33, 256, 1024, 128, 128, 2),
                                                         (64, 64, 512, 64, 64, None)])
def test_gemv_dot_swapped(fmt, m, n, k, block_n, block_k, split):
    """The tensor-core GEMV with the weight rows as the MMA's long side (what gemv_fp8 runs above
    batch 1) against float64, over uneven rows (N % block_n), uneven K (K % block_k) and split K,
    twice (its split-K tickets reset themselves), and equal to the plain form up to fp32 order."""
    torch.manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV) * 3
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    if fmt == "fp8":
        w_q, w_s = fp8.quantize_weight(w)
        x_q, x_s = quant_fp8_per_token(x)
        args, ref = (x_q, w_q, x_s, w_s), gemv_fp8_ref(x_q, x_s, w_q, w_s)
    else:
        args, ref = (x, w), gemv_bf16_ref(x, w)
    tile = dict(block_n=block_n, block_k=block_k, split_k=split, num_warps=4, num_stages=3)
    for _ in range(2):
        out = gemv_dot(*args, out=poisoned(m, n), swap=True, **tile)
        assert torch.isfinite(out).all()
        assert rel(out, ref) <= 1e-2
    assert rel(out, gemv_dot(*args, out=poisoned(m, n), split_k=split)) <= 1e-2


def test_gemv_fp8_default_tiles_and_explicit_arguments(monkeypatch):
    """gemv_fp8 takes its plain default tile (DOT_TILE above batch 1, M1_TILE at batch 1) where the caller gives
    none, each argument given over it, and a whole tile as given."""
    seen = []
    monkeypatch.setattr(gemv_fp8_module, "gemv_dot", lambda *a, **kw: seen.append(kw) or gemv_dot(*a, **kw))
    w_q = torch.zeros(64, 256, dtype=torch.float8_e4m3fn, device=DEV)
    x_q, x_s, w_s = torch.zeros(4, 256, dtype=torch.float8_e4m3fn, device=DEV), torch.ones(4, 1, device=DEV), \
        torch.ones(64, 1, device=DEV)
    whole = dict(block_n=32, block_k=64, num_warps=4, split_k=2, num_stages=2)
    for kw in ({}, dict(block_k=64), whole):
        assert torch.equal(gemv_fp8(x_q, x_s, w_q, w_s, **kw), torch.zeros(4, 64, dtype=torch.bfloat16, device=DEV))
    assert seen[0]["swap"] and {k: seen[0][k] for k in gemv_fp8_module.DOT_TILE} == gemv_fp8_module.DOT_TILE
    assert seen[1]["block_k"] == 64 and seen[1]["block_n"] == gemv_fp8_module.DOT_TILE["block_n"]
    assert {k: seen[2][k] for k in whole} == whole
    seen_m1 = []
    real = gemv_fp8_module._gemv_fp8_m1
    monkeypatch.setattr(gemv_fp8_module, "_gemv_fp8_m1", lambda *a, **kw: seen_m1.append(a[4:10]) or real(*a, **kw))
    gemv_fp8(x_q[:1], x_s[:1], w_q, w_s)
    gemv_fp8(x_q[:1], x_s[:1], w_q, w_s, num_warps=2)
    t = gemv_fp8_module.M1_TILE
    assert seen_m1[0][1:] == (t["block_n"], t["block_k"], None, t["num_warps"], t["num_stages"])
    assert seen_m1[1][1:] == (t["block_n"], t["block_k"], None, 2, t["num_stages"])


@pytest.mark.parametrize("m,n,k,split", [(1, 48, 512, None), (1, 40, 768, 2), (6, 32, 768, 2), (17, 16, 512, 1)])
def test_gemv_bf16(m, n, k, split):
    torch.manual_seed(m * 1000 + n + 2)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    for _ in range(2):
        out = gemv_bf16(x, w, out=poisoned(m, n), split_k=split)
        assert torch.isfinite(out).all()
        assert rel(out, gemv_bf16_ref(x, w)) <= 1e-2
    if m == 1:  # CUDA-core and tensor-core paths agree to fp32 summation order
        assert rel(gemv_bf16(x, w, path="fma"), gemv_bf16(x, w, path="dot")) <= 1e-2
    with pytest.raises(ValueError, match="M <= 64"):
        gemv_bf16(torch.zeros(65, k, dtype=torch.bfloat16, device=DEV), w)


@pytest.mark.parametrize("i,k,block_n,block_k", [(40, 512, 8, 256), (24, 768, 16, 512)])
def test_gemv_bf16_silu(i, k, block_n, block_k):
    """Batch 1, a BF16 fused gate_up with silu·mul in its epilogue equals the two-launch path
    (gemv_bf16, then silu_mul_quant "bf16") bit for bit, and the float64 product to bf16 rounding."""
    torch.manual_seed(i + k)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    w = torch.randn(2 * i, k, dtype=torch.bfloat16, device=DEV) * 2 / k**0.5
    h = gemv_bf16(x, w, out=poisoned(1, i), silu=True, block_n=block_n, block_k=block_k)
    gu = gemv_bf16(x, w, split_k=1, block_n=block_n, block_k=block_k)
    assert torch.equal(h, silu_mul_quant(gu[:, :i], gu[:, i:], "bf16"))
    g64, u64 = (x.double() @ w.double().T).split(i, dim=1)
    assert rel(h, g64 * g64.sigmoid() * u64) <= 1e-2
    with pytest.raises(ValueError, match="even rows"):
        gemv_bf16(x, w[:-1], silu=True)
    with pytest.raises(ValueError, match="M = 1"):
        gemv_bf16(x.repeat(2, 1), w, silu=True)


@pytest.mark.parametrize("n,k", list(M1_TILES["bf16"]))
def test_gemv_bf16_m1_rule_tiles(n, k):
    """The batch-1 tile the runtime gives each of the 4B's BF16 shapes (down to 4 rows a CTA, 8 warps on the
    wide K) computes the product at the shape's full K on ROWS rows; the fused gate_up (18432 rows) as the
    runtime runs it, with silu·mul in its epilogue."""
    torch.manual_seed(n + k)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    tile = M1_TILES["bf16"][n, k]
    if n == 18432:
        w = torch.randn(2 * ROWS, k, dtype=torch.bfloat16, device=DEV) * 2 / k**0.5
        h = gemv_bf16(x, w, out=poisoned(1, ROWS), silu=True, **tile)
        g64, u64 = (x.double() @ w.double().T).split(ROWS, dim=1)
        assert rel(h, g64 * g64.sigmoid() * u64) <= 1e-2
    else:
        w = torch.randn(ROWS, k, dtype=torch.bfloat16, device=DEV) / k**0.5
        out = gemv_bf16(x, w, out=poisoned(1, ROWS), **tile)
        assert torch.isfinite(out).all() and rel(out, gemv_bf16_ref(x, w)) <= 1e-2


@pytest.mark.parametrize("m,i", [(1, 320), (6, 2048 + 64), (9, 96)])
def test_silu_mul_quant(m, i):
    torch.manual_seed(m + i)
    gu = torch.randn(m, 2 * i, dtype=torch.bfloat16, device=DEV) * 2
    gate, up = gu[:, :i], gu[:, i:]  # halves of a fused gate_up output: strided rows
    gate[0, : i // 2] = 0  # zeros and a half-zero row
    q, s = silu_mul_quant(gate, up, "fp8", block=256)
    q_ref, s_ref = silu_mul_quant_ref(gate, up, "fp8")
    assert torch.equal(s, s_ref)
    assert fp8_codes_match(q, q_ref)
    exact = (gate.double().sigmoid() * gate.double() * up.double())
    assert rel(q.double() * s.double(), exact) <= 4e-2  # fp8 rounding, against float64

    gs = nvfp4.global_scale_from_absmax(exact.abs().max().to(torch.bfloat16))
    p, sc = silu_mul_quant(gate, up, "nvfp4", input_global_scale=gs, block=256)
    p_ref, sc_ref = silu_mul_quant_ref(gate, up, "nvfp4", input_global_scale=gs)
    assert torch.equal(sc.view(torch.uint8), sc_ref.view(torch.uint8))
    assert torch.equal(p, p_ref)

    # bf16: the product alone, what a W4A16 down_proj reads, equal to torch's two ops; with
    # pairs also its NVFP4 activation pairs (gemv_nvfp4's batch-1 input)
    h_ref = silu_mul_quant_ref(gate, up, "bf16")
    assert torch.equal(silu_mul_quant(gate, up, "bf16", block=256), h_ref)
    if i % 16 == 0:
        h, (words, scales) = silu_mul_quant(gate, up, "bf16", block=256, pairs=True)
        w_ref, s_ref = nvfp4_x_pairs_ref(h_ref)
        assert torch.equal(h, h_ref) and torch.equal(words, w_ref) and torch.equal(scales, s_ref)
    # fp8 with half: the same codes, and their values × 2^-8 in fp16 (gemv_fp8's batch-1 input)
    q2, s2, half = silu_mul_quant(gate, up, "fp8", block=256, half=True)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    assert torch.equal(half, q.to(torch.float16) * 2.0**-8)


def _gdn_inputs(bsz, slots, H, HV, K, V, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)

    C = 2 * H * K + HV * V
    return dict(qkv=r(bsz, C), z=r(bsz, HV * V), a=r(bsz, HV), b=r(bsz, HV),
                conv_state=r(slots, C, 3), conv_weight=r(C, 4, scale=0.5),
                A_log=r(HV, scale=0.5, dtype=torch.float32), dt_bias=r(HV, dtype=torch.float32),
                norm_weight=r(V, scale=0.3) + 1, state=r(slots, HV, V, K, scale=0.2, dtype=torch.float32))


@pytest.mark.parametrize("H,HV,K,V,vb", [(2, 4, 32, 32, 1), (2, 4, 32, 32, 2), (1, 1, 16, 64, 4), (1, 2, 64, 128, 1)])
def test_gdn_decode_matches_reference_and_skips_padding(H, HV, K, V, vb):
    """vb: V-blocks per value head; above 1 the o norm and the q/k conv shift go through the
    per-key-head ticket (the last program does them). A state tile above 32 × 128 (the last
    case) is loaded after the wait and streamed past L2, as at B ≥ 8 on the 4B."""
    inp = _gdn_inputs(4, 6, H, HV, K, V, seed=H * 100 + K)
    slots = torch.tensor([4, 0, -1, 2], dtype=torch.int32, device=DEV)  # row 2 is padding
    out_ref, cs_ref, st_ref = gdn_decode_ref(**inp, slots=slots, num_k_heads=H, head_k_dim=K, head_v_dim=V)
    cs0, st0 = inp["conv_state"].clone(), inp["state"].clone()
    out = gdn_decode(**inp, slots=slots, num_k_heads=H, head_k_dim=K, head_v_dim=V,
                     out=poisoned(4, HV * V, torch.float32), v_blocks=vb)
    assert rel(out, out_ref) <= 1e-3
    assert rel(inp["state"], st_ref) <= 1e-3
    assert torch.equal(inp["conv_state"], cs_ref)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    for s in (1, 3, 5):  # slots no row points at are untouched
        assert torch.equal(inp["state"][s], st0[s]) and torch.equal(inp["conv_state"][s], cs0[s])
    # quant="fp8": the output also quantized per token in the same launch (an FP8 out_proj's
    # input), exactly quant_fp8_per_token's codes, scales and fp16 pairs of the bf16 output
    for half in (False, True):
        inp2 = _gdn_inputs(4, 6, H, HV, K, V, seed=H * 100 + K)
        o, got = gdn_decode(**inp2, slots=slots, num_k_heads=H, head_k_dim=K, head_v_dim=V, v_blocks=vb,
                            quant="fp8", half=half)
        want = quant_fp8_per_token(o, half=half)
        assert len(got) == len(want) and all(torch.equal(g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g,
                                                         w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w)
                                              for g, w in zip(got, want))
    # quant="amax": the same output, and each key head's max |out| over its G·V values (what
    # gemv_fp8_quantizing reads at batch 1); a padding row's parts are 0
    inp3 = _gdn_inputs(4, 6, H, HV, K, V, seed=H * 100 + K)
    o3, (amax,) = gdn_decode(**inp3, slots=slots, num_k_heads=H, head_k_dim=K, head_v_dim=V, v_blocks=vb, quant="amax")
    assert torch.equal(o3, o) and amax.shape == (4, H)
    assert torch.equal(amax, o3.float().abs().reshape(4, H, -1).amax(-1))


def test_gdn_decode_two_steps_equal_transformers_recurrence():
    """Two decode steps through our kernel equal transformers' own torch recurrence
    (torch_recurrent_gated_delta_rule, state [B, HV, K, V]) fed the same q/k/v: the state
    layout [V, K] is not transposed."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    H, HV, K, V = 1, 2, 16, 32
    inp = _gdn_inputs(1, 1, H, HV, K, V, seed=7)
    inp["conv_weight"] = torch.zeros_like(inp["conv_weight"])
    inp["conv_weight"][:, -1] = 1  # conv = identity tap, so q/k/v = silu(qkv)
    state_tf = inp["state"].transpose(-1, -2).contiguous()  # transformers keeps [.., K, V]
    slots = torch.zeros(1, dtype=torch.int32, device=DEV)
    for step in range(2):
        qkv = inp["qkv"].float() if step == 0 else torch.randn_like(inp["qkv"].float()).to(torch.bfloat16).float()
        inp["qkv"] = qkv.to(torch.bfloat16)
        x = torch.nn.functional.silu(inp["qkv"].float())
        q, k, v = x.split([H * K, H * K, HV * V], -1)
        q = q.view(1, 1, H, K).repeat_interleave(HV // H, 2)
        k = k.view(1, 1, H, K).repeat_interleave(HV // H, 2)
        g = -inp["A_log"].exp() * torch.nn.functional.softplus(inp["a"].float() + inp["dt_bias"])
        # keywords: with fla-core importable transformers runs fla-core's kernel here, whose fifth
        # positional parameter is not beta
        o_tf, state_tf = torch_recurrent_gated_delta_rule(q, k, v.view(1, 1, HV, V), g=g.view(1, 1, HV),
                                                          beta=inp["b"].float().sigmoid().view(1, 1, HV),
                                                          initial_state=state_tf, output_final_state=True,
                                                          use_qk_l2norm_in_kernel=True)
        gdn_decode(**inp, slots=slots, num_k_heads=H, head_k_dim=K, head_v_dim=V,
                   out=torch.empty(1, HV * V, device=DEV))
        assert rel(inp["state"], state_tf.transpose(-1, -2)) <= 1e-4


@pytest.mark.parametrize("heads,kvh,hd,max_len", [(8, 2, 32, 600), (4, 4, 64, 300)])
def test_attn_decode_matches_reference(heads, kvh, hd, max_len):
    """Split-sequence decode attention against float64 softmax over each row's visible prefix:
    rows at length 0, inside the first chunk, across chunks and at the last position."""
    torch.manual_seed(heads + max_len)
    kc = torch.randn(5, kvh, max_len, hd, dtype=torch.bfloat16, device=DEV)
    vc = torch.randn_like(kc)
    q = torch.randn(4, heads, hd, dtype=torch.bfloat16, device=DEV)
    slots = torch.tensor([3, 0, 4, 1], dtype=torch.int32, device=DEV)
    lengths = torch.tensor([0, 100, max_len - 1, 257], dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    attn_decode(q, kc, vc, slots, lengths, hd**-0.5, out=out)
    want = attn_decode_ref(q, kc, vc, slots, lengths, hd**-0.5)
    assert not out.isnan().any()
    assert rel(out, want) <= 1e-2
    # a row sees nothing past its length: changing later cache positions leaves it unchanged
    kc[0, :, 101:] = 100.0
    again = attn_decode(q, kc, vc, slots, lengths, hd**-0.5)
    assert torch.equal(again[1], out[1])
    # the output gate (a strided view, as q_proj's interleaved q/gate output gives it)
    qg = torch.randn(4, heads, 2 * hd, dtype=torch.bfloat16, device=DEV)
    gated = attn_decode(q, kc, vc, slots, lengths, hd**-0.5, gate=qg[:, :, hd:])
    want_gated = attn_decode_ref(q, kc, vc, slots, lengths, hd**-0.5, gate=qg[:, :, hd:])
    assert rel(gated, want_gated) <= 1e-2
    # batch 1 chunks the sequence its own way (CHUNK_B1): each row alone, with its amax parts
    for i in range(4):
        one, (amax1,) = attn_decode(q[i:i + 1], kc, vc, slots[i:i + 1], lengths[i:i + 1], hd**-0.5,
                                 gate=qg[i:i + 1, :, hd:], quant="amax")
        assert rel(one, want_gated[i:i + 1]) <= 1e-2 and torch.equal(amax1, one.float().abs().amax(-1))
    # quant="fp8": each row also quantized per token in the merge launch (an FP8 o_proj's
    # input), exactly quant_fp8_per_token's codes and scales of the bf16 output
    o, (q8, s8) = attn_decode(q, kc, vc, slots, lengths, hd**-0.5, gate=qg[:, :, hd:], quant="fp8")
    assert torch.equal(o, gated)
    want_q, want_s = quant_fp8_per_token(o.reshape(4, -1))
    assert torch.equal(q8.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s8, want_s)
    # quant="amax": the same output, and each head's max |out| (gemv_fp8_quantizing's input at batch 1)
    o2, (amax,) = attn_decode(q, kc, vc, slots, lengths, hd**-0.5, gate=qg[:, :, hd:], quant="amax")
    assert torch.equal(o2, gated) and torch.equal(amax, gated.float().abs().amax(-1))


@pytest.mark.parametrize("heads,kvh,hd,rot", [(4, 2, 32, 8), (16, 4, 256, 64)])
def test_qk_norm_rope_equals_torch_ops(heads, kvh, hd, rot):
    """q/k RMSNorm + RoPE + the cache write in one launch give the torch backend's bf16 values
    exactly (the same roundings), from strided views of a fused q/gate + k + v output."""
    torch.manual_seed(heads + hd)
    b, max_len = 3, 40
    fused = torch.randn(b, heads * 2 * hd + 2 * kvh * hd, dtype=torch.bfloat16, device=DEV) * 2
    qg, k, v = fused.split([heads * 2 * hd, kvh * hd, kvh * hd], dim=-1)
    q = qg.reshape(b, heads, 2 * hd)[:, :, :hd]
    qw, kw = (torch.randn(hd, dtype=torch.bfloat16, device=DEV) * 0.1 for _ in range(2))
    ang = torch.randn(b, rot // 2, device=DEV) * 3
    cos = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16)
    sin = torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16)
    slots = torch.tensor([2, 0, 4], dtype=torch.int32, device=DEV)
    lengths = torch.tensor([0, 17, max_len - 1], dtype=torch.int32, device=DEV)
    caches = [torch.randn(5, kvh, max_len, hd, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    got = qk_norm_rope(q, k, v, qw, kw, 1e-6, cos, sin, *caches, slots, lengths)
    want = qk_norm_rope_ref(q, k, v, qw, kw, 1e-6, cos, sin, *ref_caches, slots, lengths)
    assert torch.equal(got, want)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


@pytest.mark.parametrize("shape", ["tiny", "qwen3.5-4b"])
def test_step_inputs_equal_the_torch_ops(shape):
    """The embedding rows, cos / sin gathered from the rope tables, and the int32 ids equal, bit
    for bit, what the torch backend computes each step (the rotary module at length + delta),
    from strided rows of a step's meta."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from ocriaquant.model.configs import SHAPES, tiny_config

    tc = (tiny_config() if shape == "tiny" else SHAPES[shape]()).text_config
    rotary = Qwen3_5TextRotaryEmbedding(tc).to(DEV)
    max_len, vocab, d = 3000, 300, 160
    torch.manual_seed(len(shape))
    embed = torch.randn(vocab, d, dtype=torch.bfloat16, device=DEV)
    # the runtime's tables: the rotary module once over every position, all three sections alike
    pos = torch.arange(max_len, device=DEV)[None].expand(3, -1)
    cos_t, sin_t = (t[0].contiguous() for t in rotary(torch.empty(0, dtype=torch.bfloat16, device=DEV),
                                                      pos[:, None, :]))
    meta = torch.zeros(4, 8, dtype=torch.long, device=DEV)  # a bucket of 8, 5 rows used
    meta[:, :5] = torch.tensor([[7, 0, 299, 42, 1], [0, 3, 1, 8, 2], [0, 5, 2999, 2000, 700],
                                [0, 0, -999, -7, -700]], device=DEV)
    rows = [r[:5] for r in meta]
    got = step_inputs(*rows, embed, cos_t, sin_t)
    want = step_inputs_ref(*rows, embed, rotary, torch.bfloat16)
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("b,v", [(1, 5000), (3, 248320), (2, 4096)])
def test_greedy_advance_equals_argmax_and_meta_update(b, v):
    """Each row's argmax (ties to the first index, a NaN first, as torch.argmax), written as the
    tokens and the next step's input: lengths + 1 except on the sentinel slot. Twice: the tickets
    reset themselves."""
    torch.manual_seed(b * v)
    sentinel = 9
    for call in range(2):
        logits = torch.randn(b, v, dtype=torch.bfloat16, device=DEV) * 4
        logits[0, v // 3] = logits[0, v - 1] = 40.0  # a tie across chunks: the first wins
        if b > 1:
            logits[1, v - 2] = float("nan")  # a NaN beats every number, as in torch.argmax
            logits[1, v - 1] = float("nan")
        if b > 2:
            logits[2] = float("-inf")  # all -inf: index 0
        meta = torch.tensor([[5] * b, [sentinel] + list(range(b - 1)), [10 * (i + 1) for i in range(b)], [0] * b],
                            dtype=torch.long, device=DEV)
        ref_meta = meta.clone()
        got = greedy_advance(logits, meta[0], meta[1], meta[2], sentinel)
        want = greedy_advance_ref(logits, ref_meta[0], ref_meta[1], ref_meta[2], sentinel)
        assert torch.equal(got, want) and torch.equal(meta, ref_meta), call
    assert int(want[0]) == v // 3 and meta[2, 0] == 10  # row 0 sits on the sentinel: its length stays
    if b > 1:
        assert int(want[1]) == v - 2 and meta[2, 1] == 21


@pytest.mark.parametrize("b,d", [(3, 160), (1, 2560)])
def test_add_rmsnorm_matches_torch_ops(b, d):
    """The fused residual add + RMSNorm gives the torch ops' BF16 sum exactly and their norm
    to within one BF16 rounding (fp32 sums in another order)."""
    torch.manual_seed(d)
    x, h = (torch.randn(b, d, device=DEV) * 3).bfloat16(), torch.randn(b, d, device=DEV).bfloat16()
    w = (torch.randn(d, device=DEV) * 0.1).bfloat16()
    r, y = add_rmsnorm(x, h, w, 1e-6)
    r_ref, y_ref = add_rmsnorm_ref(x, h, w, 1e-6)
    assert torch.equal(r, r_ref)
    assert rel(y, y_ref) <= 4e-3 and float((y == y_ref).float().mean()) >= 0.98
    r2, y2 = add_rmsnorm(x, None, w, 1e-6)
    assert r2 is x and rel(y2, add_rmsnorm_ref(x, None, w, 1e-6)[1]) <= 4e-3
    # quant="fp8": the bf16 output is the same, and its FP8 codes and scale are quant_fp8_per_token's;
    # at B = 1 also the codes' values × 2^-8 in fp16, what gemv_fp8's batch-1 kernel reads
    r3, y3, (q3, s3, *half) = add_rmsnorm(x, h, w, 1e-6, quant="fp8")
    assert torch.equal(r3, r) and torch.equal(y3, y)
    q_ref, s_ref = quant_fp8_per_token(y3)
    assert torch.equal(s3, s_ref) and fp8_codes_match(q3, q_ref)
    assert len(half) == (b == 1)
    if half:
        assert torch.equal(half[0], q3.to(torch.float16) * 2.0**-8)
    # quant="nvfp4": at B = 1 y's activation pairs for gemv_nvfp4's batch-1 kernel; none above
    out = add_rmsnorm(x, h, w, 1e-6, quant="nvfp4")
    assert torch.equal(out[1], y)
    if b == 1:
        words, scales = out[2]
        w_ref, s_ref = nvfp4_x_pairs_ref(y)
        assert torch.equal(words, w_ref) and torch.equal(scales, s_ref)
    else:
        assert len(out) == 2
    # programs that each write a slice of the row (the last one partial) give the same bytes
    for quant in (None, "fp8", "nvfp4"):
        whole, sliced = add_rmsnorm(x, h, w, 1e-6, quant, slice_d=4096), add_rmsnorm(x, h, w, 1e-6, quant, slice_d=64)
        assert all(torch.equal(a.view(torch.uint8), c.view(torch.uint8))
                   for a, c in zip([*whole[:2], *(whole[2] if len(whole) > 2 else [])],
                                   [*sliced[:2], *(sliced[2] if len(sliced) > 2 else [])]))


def test_nvfp4_x_pairs_equal_reference():
    """The NVFP4 activation pairs (half2.nvfp4_pairs) equal an independent torch construction,
    bit for bit, over 40 decades of magnitude, an all-zero block, blocks whose small values
    become fp16 subnormals, and a row that is not a whole number of kernel blocks. A block of
    fp32 subnormals (|x| < 2^-126) only has to stay finite and tiny: the interpreter's and the
    GPU's handling of those differ, and they add nothing a BF16 output could hold."""
    torch.manual_seed(11)
    k = 1024 + 96
    x = torch.randn(3, k, device=DEV) * torch.logspace(-30, 10, k, device=DEV)
    x[0, :16] = 0
    x[2, 32:48:3] *= 2.0**-20  # fp16 subnormals once scaled
    x[1, 16:32] = 1e-39  # fp32 subnormals
    x = x.bfloat16()
    words, scales = nvfp4_x_pairs(x, block=512)
    w_ref, s_ref = nvfp4_x_pairs_ref(x)
    tiny = torch.zeros(3, k // 2, dtype=torch.bool, device=DEV)
    tiny[1, 8:16] = True
    assert torch.equal(words[~tiny], w_ref[~tiny]) and torch.equal(scales, s_ref)
    sub = words[1, 8:16].contiguous().view(torch.float16).double() * float(scales[1, 1]) * 2.0**-14
    assert bool((sub.abs() <= 2e-38).all())
    # decoded back, the pairs times their scales are x wherever fp16 holds it (all but the
    # values under 2^-29 of their block's maximum)
    h = words.view(torch.float16).reshape(3, k // 16, 16)[..., [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]]
    back = (h.double() * scales[..., None].double() * 2.0**-14).reshape(3, k)
    big = x.double().abs() >= x.double().reshape(3, -1, 16).abs().amax(-1).repeat_interleave(16, -1) * 2.0**-29
    big[1, 16:32] = False
    assert torch.equal(back[big], x.double()[big])


def test_pdl_only_on_the_gpu(monkeypatch):
    """PDL is a launch attribute of CUDA kernels: a CPU tensor (the interpreter, CI) never asks
    for it, whatever the caller says, so the kernels take their plain path there (every test
    above); on CUDA the caller's choice wins, and with none PDL is on from compute capability 9.
    The kernels read no environment variable for it (the runtime's configuration passes pdl)."""
    monkeypatch.setenv("OCRIAQUANT_PDL", "0")  # not read here
    cpu = torch.device("cpu")
    assert not use_pdl(cpu, None) and not use_pdl(cpu, True)
    cuda = torch.device("cuda")
    assert use_pdl(cuda, True) and not use_pdl(cuda, False)  # explicit choices need no GPU query
    for major in (8, 9):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, major=major: (major, 0))
        assert use_pdl(cuda, None) == (major >= 9)


def test_l2_ahead_never_past_the_split_nor_under_the_interpreter():
    """The tiles the batch-1 FP8 GEMV asks L2 for before its wait: what gemv_fp8.M1_L2_AHEAD asks, cut to the
    tiles its split has after the first and to a power of two (prefetch_ahead's line count), none under the
    interpreter (the prefetch is PTX). The prefetch itself changes no output: the GPU tests compare outputs
    with it on (test_gemv_pdl_in_graph, the GEMV tests at multi-tile splits)."""
    assert [l2_ahead(False, t, 1) for t in (0, 1, 4)] == [0, 1, 1]
    assert [l2_ahead(False, t, 3) for t in (0, 1, 2, 3, 7)] == [0, 1, 2, 2, 2]
    assert l2_ahead(True, 4, 1) == 0 and l2_ahead(False, 4, 0) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch needs a CUDA GPU "
                    "(test_pdl_only_on_the_gpu covers the CPU side)")
def test_gemv_pdl_in_graph():
    """With PDL a GEMV starts while its producer runs and waits for it before reading x: in a
    CUDA graph behind add_rmsnorm (which releases it early) every format gives the same output
    as without PDL, replay after replay on changing inputs — also a GEMV that reads the one
    before it."""
    n, k = 4096, 2560
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    w_sq = torch.randn(k, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    w_q, w_s = fp8.quantize_weight(w)
    packed, scales, gs = nvfp4.quantize_weight(w)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    h = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    norm_w = torch.randn(k, dtype=torch.bfloat16, device=DEV) * 0.1

    def step(pdl):
        _, y, (q, s, half) = add_rmsnorm(x, h, norm_w, 1e-6, quant="fp8", pdl=True)
        _, _, pairs = add_rmsnorm(x, h, norm_w, 1e-6, quant="nvfp4", pdl=True)
        return (gemv_bf16(y, w, pdl=pdl), gemv_fp8(q, s, w_q, w_s, pdl=pdl, x_half=half),
                gemv_nvfp4(y, packed, scales, gs, pdl=pdl, x_pairs=pairs),
                gemv_bf16(gemv_bf16(y, w_sq, pdl=pdl), w_sq, pdl=pdl))  # the second reads the first

    step(True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step(True)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        for got, want in zip(outs, step(False)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("n,c,start", [(70, 200, False), (70, 200, True), (2, 96, True), (33, 128, False)])
def test_conv_silu_matches_reference_over_rows_as_they_lie(n, c, start):
    """A GDN prefill chunk's conv + SiLU on rows that are a view of a wider projection output (row stride
    > C), from zeros or a slot's history, ragged in rows and channels, fewer rows than taps: within a bf16
    rounding of float64 (the conv's bf16 rounding before SiLU included) and of the torch backend's ops."""
    torch.manual_seed(n + c)
    k = 4
    wide = torch.randn(n, c + 40, dtype=torch.bfloat16, device=DEV)
    x = wide[:, 8:8 + c]
    weight = torch.randn(c, k, dtype=torch.bfloat16, device=DEV) / 2
    history = torch.randn(c, k - 1, dtype=torch.bfloat16, device=DEV) if start else None
    got = conv_silu(x, history, weight)
    h = history if start else torch.zeros(c, k - 1, dtype=torch.bfloat16, device=DEV)
    padded = torch.cat([h, x.T], dim=1).double()
    conv = (padded.unfold(1, k, 1) * weight.double()[:, None, :]).sum(-1).to(torch.bfloat16).double()
    exact = (conv * torch.sigmoid(conv)).T
    assert got.shape == (n, c) and got.is_contiguous()
    assert bool(((got.double() - exact).abs() <= exact.abs() * 2**-8 * 1.01 + 1e-30).all())  # rounded, half an ulp
    assert (got != reference.conv_silu_ref(x, history, weight)).float().mean() <= 0.01  # the torch ops' values
    if start:  # the history is read: the first rows differ from a prompt's first chunk
        assert not torch.equal(got[:k - 1], conv_silu(x, None, weight)[:k - 1])
    m = min(3, n)
    both = torch.zeros(m + n, c, dtype=torch.bfloat16, device=DEV)  # into a pass's buffer, beside another chunk
    conv_silu(x, history, weight, out=both[m:])
    conv_silu(x[:m], None, weight, out=both[:m])
    assert torch.equal(both[m:], got) and torch.equal(both[:m], conv_silu(x[:m], None, weight))


@pytest.mark.parametrize("n,hv,v", [(37, 4, 32), (5, 3, 48)])
def test_gated_rmsnorm_rows_give_the_torch_backends_values(n, hv, v):
    """The GDN output's gated norm over prefill rows, z a view of a wider fused projection output:
    the torch backend's values (its roundings: the weight multiplied in bf16, the product rounded
    once), all but a rare last bit, and within half a bf16 ulp of those roundings in float64."""
    torch.manual_seed(n * hv)
    x = torch.randn(n, hv, v, dtype=torch.bfloat16, device=DEV) * 3
    fused = torch.randn(n, hv * v + 24, dtype=torch.bfloat16, device=DEV)
    z = fused[:, 24:]
    w = (torch.rand(v, device=DEV) + 0.5).to(torch.bfloat16)
    got = gated_rmsnorm(x, z, w, 1e-6)
    want = reference.gated_rmsnorm_ref(x.reshape(-1, v), z.reshape(-1, v), w, 1e-6).reshape(n, -1)
    assert got.shape == want.shape and (got != want).float().mean() <= 0.01
    xd = x.double()
    h = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    h = (w.double() * h.double()).to(torch.bfloat16).double()
    zd = z.double().reshape(n, hv, v)
    exact = (h * zd * torch.sigmoid(zd)).reshape(n, -1)
    assert bool(((got.double() - exact).abs() <= exact.abs() * 2**-8 * 1.01 + 1e-30).all())


@pytest.mark.parametrize("S,H,D", [(100, 2, 32), (9, 3, 72)])
def test_vision_rope_gives_transformers_q_k_v_for_sdpa(S, H, D):
    """The vision tower's rope and layout from the qkv rows (a view of a wider buffer): the values of
    transformers' apply_rotary_pos_emb_vision after its unbind and transposes (the reference is those
    ops, checked here against transformers' own function), all but a rare last bit, and within half
    a bf16 ulp of the float64 rotation; v moved as it is. D = 72: a half that is no power of two."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb_vision

    torch.manual_seed(S + D)
    wide = torch.randn(S, 3 * H * D + 16, dtype=torch.bfloat16, device=DEV) * 2
    qkv = wide[:, 16:]
    theta = torch.rand(S, D // 2, device=DEV) * 40
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)  # transformers' layout
    got = vision_rope(qkv, cos, sin, H)
    want = reference.vision_rope_ref(qkv, cos, sin, H)
    q, k, v = qkv.reshape(S, 3, H, D).permute(1, 0, 2, 3).unbind(0)
    hf_q, hf_k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    assert torch.equal(want[0][0], hf_q.transpose(0, 1)) and torch.equal(want[1][0], hf_k.transpose(0, 1))
    for g, w in zip(got, want):
        assert g.shape == (1, H, S, D) and g.is_contiguous() and (g != w).float().mean() <= 0.01
    assert torch.equal(got[2], want[2])
    for g, x in zip(got[:2], (q, k)):
        xd = x.double()
        x1, x2 = xd.chunk(2, -1)
        exact = (xd * cos.double()[:, None] + torch.cat((-x2, x1), -1) * sin.double()[:, None]).transpose(0, 1)
        assert bool(((g[0].double() - exact).abs() <= exact.abs() * 2**-8 * 1.01 + 1e-6).all())
    with pytest.raises(ValueError, match="vision_rope"):
        vision_rope(qkv.float(), cos, sin, H)

