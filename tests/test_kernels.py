"""Every Triton kernel against its reference on fresh random inputs. On the CPU this runs under
TRITON_INTERPRET=1 at small shapes (the README's test command sets it); scripts/bench_kernels.py
runs the same checks at Qwen3.5-4B shapes on the GPU."""

import importlib
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need a GPU or TRITON_INTERPRET=1")

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


@pytest.mark.parametrize("m,k", [(1, 4096), (3, 1000), (1, 5000)])
def test_quant_fp8_per_token_slices(m, k):
    """Activation quantization equals quant/'s (compressed-tensors-exact) numerics however the
    row is shared out among programs (each reads it whole for the scale, writes a slice)."""
    from ocriaquant.quant import fp8
    from ocriaquant.runtime.kernels import quant_fp8_per_token

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
    from ocriaquant.quant import fp8
    from ocriaquant.runtime.kernels import gemv_fp8, gemv_fp8_ref, quant_fp8_per_token

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


@pytest.mark.parametrize("n,k", [(12352, 2560), (10240, 2560), (2560, 4096), (2560, 9216)])
def test_gemv_fp8_m1_rule_tiles(n, k):
    """The batch-1 tile tiles.m1_tile gives each of the 4B's FP8 shapes (split K, 8 warps, 64 or 128
    rows) computes the product, on 200 of the shape's rows at its full K (ragged last row tile)."""
    from ocriaquant.quant import fp8
    from ocriaquant.runtime.kernels import gemv_fp8, gemv_fp8_quantizing, gemv_fp8_ref, quant_fp8_per_token
    from ocriaquant.runtime.kernels.tiles import m1_tile

    torch.manual_seed(n + k)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV) * 3
    w_q, w_s = fp8.quantize_weight(torch.randn(200, k, dtype=torch.bfloat16, device=DEV) / k**0.5)
    x_q, x_s = quant_fp8_per_token(x)
    tile = m1_tile("fp8", n, k)
    out = gemv_fp8(x_q, x_s, w_q, w_s, out=poisoned(1, 200), path="half2", **tile)
    assert torch.isfinite(out).all()
    assert rel(out, gemv_fp8_ref(x_q, x_s, w_q, w_s)) <= 1e-2
    if k == 4096:  # out_proj / o_proj quantize their input themselves, from gdn_decode's / attention's amax,
        amax = x.float().abs().amax().reshape(1)  # on a tile of their own (split: not every CTA quantizes all of K)
        qx_tile = m1_tile("fp8_qx", n, k)
        assert qx_tile != tile and qx_tile["split_k"] > 1
        # bit for bit what quantizing first and then running the plain GEMV on the same tile gives
        same_tile = gemv_fp8(x_q, x_s, w_q, w_s, out=poisoned(1, 200), path="half2", **qx_tile)
        assert rel(same_tile, gemv_fp8_ref(x_q, x_s, w_q, w_s)) <= 1e-2
        assert torch.equal(gemv_fp8_quantizing(x, amax, w_q, w_s, out=poisoned(1, 200), **qx_tile), same_tile)


@pytest.mark.parametrize("n,k", [(12352, 2560), (2560, 4096), (2560, 9216)])
def test_gemv_nvfp4_m1_rule_tiles(n, k):
    """The batch-1 tile tiles.m1_tile gives each of the 4B's NVFP4 shapes (down_proj: 8 rows on 2 warps, K in
    3 splits) computes the product on 200 of the shape's rows at its full K (ragged last row tile), reduced in
    the kernel and as the partials add_rmsnorm sums."""
    from ocriaquant.quant import nvfp4
    from ocriaquant.runtime.kernels import gemv_nvfp4, gemv_nvfp4_ref
    from ocriaquant.runtime.kernels.tiles import m1_tile

    torch.manual_seed(n + k + 1)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    packed, scales, gs = nvfp4.quantize_weight(torch.randn(200, k, dtype=torch.bfloat16, device=DEV) / k**0.5)
    ref = gemv_nvfp4_ref(x, packed, scales, gs)
    tile = m1_tile("nvfp4", n, k)
    out = gemv_nvfp4(x, packed, scales, gs, out=poisoned(1, 200), path="fma", **tile)
    assert torch.isfinite(out).all() and rel(out, ref) <= 1e-2
    if tile.get("split_k", 1) > 1:
        parts = gemv_nvfp4(x, packed, scales, gs, path="fma", partials=True, **tile).parts
        assert parts.shape[0] == tile["split_k"] and rel(parts.double().sum(0), ref) <= 1e-2


@pytest.mark.parametrize("pure", [0, 1, 2])
@pytest.mark.parametrize("block_n,block_k,warps,split", [(64, 512, 8, 1), (16, 256, 4, 2), (8, 1024, 2, 2)])
def test_gemv_nvfp4_m1_load_forms(monkeypatch, pure, block_n, block_k, warps, split):
    """The batch-1 kernel with its activations and block scales read either way (gemv_nvfp4.M1_PURE: laid out as
    the tile uses them, on K-tiles of up to 512, or with 2 on every tile; or converted into its layout), on tiles
    of both kinds: against float64, and with one-hot activations exactly the dequantized weight's columns, over a
    zero block and a ragged last row tile."""
    from ocriaquant.quant import nvfp4
    from ocriaquant.runtime.kernels import gemv_nvfp4, gemv_nvfp4_ref

    # the module: the package's gemv_nvfp4 is the function
    gemv_nvfp4_module = importlib.import_module("ocriaquant.runtime.kernels.gemv_nvfp4")
    monkeypatch.setattr(gemv_nvfp4_module, "M1_PURE", pure)
    assert gemv_nvfp4_module.pure_loads(block_k, False) == (pure == 2 or (pure == 1 and block_k <= 512))
    assert gemv_nvfp4_module.pure_loads(block_k, True) == (pure == 2)
    n, k = 76, 2 * split * block_k  # 76: a ragged last row tile at 8, 16 and 64 rows
    torch.manual_seed(block_k + pure)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    w[3, 16:32] = 0
    packed, scales, gs = nvfp4.quantize_weight(w)
    tile = dict(block_n=block_n, block_k=block_k, num_warps=warps, split_k=split, path="fma")
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    out = gemv_nvfp4(x, packed, scales, gs, out=poisoned(1, n), **tile)
    assert torch.isfinite(out).all() and rel(out, gemv_nvfp4_ref(x, packed, scales, gs)) <= 1e-2
    # a register cap (tiles.m1_tile's maxnreg; on the GPU a different compile) sums the same blocks the same way
    assert torch.equal(gemv_nvfp4(x, packed, scales, gs, out=poisoned(1, n), maxnreg=128, **tile), out)
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
    from ocriaquant.quant import fp8
    from ocriaquant.runtime.kernels import gemv_fp8, gemv_fp8_quantizing, gemv_fp8_ref, quant_fp8_per_token

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
    from ocriaquant.quant import nvfp4
    from ocriaquant.runtime.kernels import gemv_nvfp4, gemv_nvfp4_ref

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
    from ocriaquant.quant import fp8, nvfp4
    from ocriaquant.runtime.kernels import add_rmsnorm, gemv_fp8, gemv_fp8_ref, gemv_nvfp4, gemv_nvfp4_ref
    from ocriaquant.runtime.partials import Partials

    torch.manual_seed(split)
    n, k = 160, 1024
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    if fmt == "fp8":
        from ocriaquant.runtime.kernels import quant_fp8_per_token

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
    from ocriaquant.quant import nvfp4
    from ocriaquant.runtime.kernels import gemv_nvfp4, silu_mul_quant
    from ocriaquant.runtime.kernels.gemv_nvfp4 import gemv_nvfp4_silu, gemv_nvfp4_silu_ref, nvfp4_x_pairs, pack_m1

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
    from ocriaquant.quant import nvfp4
    from ocriaquant.runtime.kernels import gemv_nvfp4, gemv_nvfp4_ref

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
    from ocriaquant.quant import fp8
    from ocriaquant.runtime.kernels import gemv_bf16_ref, gemv_fp8_ref, quant_fp8_per_token
    from ocriaquant.runtime.kernels.gemv_dot import gemv_dot

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


@pytest.mark.parametrize("form", ["nvfp4_m1", "fp8_m1", "bf16_m1", "fp8_dot", "bf16_plain", "nvfp4_dot"])
def test_split_reductions_agree_and_leave_the_workspace_unset(monkeypatch, form):
    """splitk.store_or_reduce's two split-K tails (SPLITK_EARLY: the ticket taken early and the partials read by
    the last arrival, in a workspace of UNSET; or the acq_rel ticket after the stores) give the same output bit for
    bit, launch after launch, and the early one leaves its workspace UNSET and its tickets at zero (what the next
    launch relies on), on a ragged last row tile."""
    from ocriaquant.quant import fp8, nvfp4
    from ocriaquant.runtime.kernels import gemv_bf16, gemv_fp8, gemv_nvfp4, quant_fp8_per_token, splitk
    from ocriaquant.runtime.kernels.gemv_dot import gemv_dot

    m, n, k, split = (1, 76, 768, 3) if form.endswith("_m1") else (8, 72, 768, 3)
    torch.manual_seed(k + n + m)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    if form.startswith("nvfp4"):
        packed, scales, gs = nvfp4.quantize_weight(w)
        run = lambda: gemv_nvfp4(x, packed, scales, gs, out=poisoned(m, n), block_n=16, block_k=256,  # noqa: E731
                                 split_k=split, path="fma" if m == 1 else "dot")
    elif form.startswith("bf16"):  # gemv_m1 at batch 1, gemv_dot's plain form above it
        run = lambda: gemv_bf16(x, w, out=poisoned(m, n), block_n=16, block_k=256, split_k=split)  # noqa: E731
    else:
        w_q, w_s = fp8.quantize_weight(w)
        x_q, x_s = quant_fp8_per_token(x)
        if form == "fp8_m1":
            run = lambda: gemv_fp8(x_q, x_s, w_q, w_s, out=poisoned(m, n), block_n=16, block_k=256,  # noqa: E731
                                   split_k=split)
        else:
            run = lambda: gemv_dot(x_q, w_q, x_s, w_s, out=poisoned(m, n), block_n=32, block_k=128,  # noqa: E731
                                   split_k=split, num_warps=4, num_stages=3, swap=True)
    monkeypatch.setattr(splitk, "SPLITK_EARLY", 0)
    old = run()
    monkeypatch.setattr(splitk, "SPLITK_EARLY", 1)
    for _ in range(2):
        new = run()
        assert torch.isfinite(new).all() and torch.equal(new.view(torch.int16), old.view(torch.int16))
    early = [v for key, v in splitk._WORKSPACES.items() if key[0] == "gemv_early" and key[2][0] == split]
    assert early
    for ws, tick in early:
        assert bool((ws.view(torch.int32) == splitk.UNSET.value).all()) and not tick.any()


_TICKET_LAYOUT = r"""
import re
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ocriaquant.runtime.kernels.splitk import store_or_reduce, take_ticket

@triton.jit
def early_tail(tick_ptr, y_ptr, ws_ptr, N, BN: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    ticket = take_ticket(tick_ptr, pid_n, SPLIT_K, True, False)
    acc = tl.zeros((1, BN), tl.float32) + pid_k
    store_or_reduce(acc, y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, 1, N, 0, 1, BN, SPLIT_K, ticket, True)

for warps in (1, 2, 4, 8):
    sig = dict(tick_ptr="*i32", y_ptr="*bf16", ws_ptr="*fp32", N="i32", BN="constexpr", SPLIT_K="constexpr")
    src = ASTSource(early_tail, sig, constexprs={(4,): 8, (5,): 3})
    asm = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm
    ir, ptx = asm["ttgir"], asm["ptx"].splitlines()
    line = next(ln for ln in ir.splitlines() if "atom.relaxed" in ln)
    size, enc = re.search(r"-> tensor<(\d+)xi32, #(\w+)>", line).groups()
    lay = re.search(rf"^#{enc} = #ttg\.blocked<\{{sizePerThread = \[(\d+)\], threadsPerWarp = \[(\d+)\], "
                    rf"warpsPerCTA = \[(\d+)\]", ir, re.M)
    # the reducer: its last read of the others' partials, then its first 32-bit store (the UNSET resets; y is bf16)
    last_read = max(i for i, ln in enumerate(ptx) if "ld.volatile.global" in ln)
    first_reset = next(i for i in range(last_read, len(ptx)) if "st.global.b32" in ptx[i])
    barrier = any("bar.sync" in ln for ln in ptx[last_read:first_reset])
    print(warps, size, *(lay.groups() if lay else ("not blocked",)), int(barrier))
"""


def test_the_early_tail_compiles_without_copies_or_a_reset_race(tmp_path):
    """The EARLY_TICKET tail, compiled for sm_90 at 1–8 warps. take_ticket's vector is laid out one element per
    thread slot with no thread holding a copy of another's element: a copy reads 0 where thread 0 read the ticket,
    and Triton reduces over one copy, taking them to be equal; with a [16] vector the threads of a CTA disagreed on
    which CTA reduces its tile, and the FP8 tensor-core GEMV hung at its tail on an H100 (BENCHMARKS.md, session
    40). And the reducer waits at a barrier between its last read of the others' partials and its first reset of
    them: its [1, 8] tile has a copy in every warp, each warp leaves the read loop on its own, and a warp that
    reset a partial another warp had not read yet hung the NVFP4 down_proj GEMV at 2 warps (session 41). The
    interpreter runs one program at a time and cannot show either, hence Triton's compiler here (no GPU needed),
    in a process of its own (from a file: @triton.jit reads its source) since TRITON_INTERPRET=1 makes
    @triton.jit build interpreted functions."""
    script = tmp_path / "ticket_layout.py"
    script.write_text(_TICKET_LAYOUT)
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert [int(r[0]) for r in rows] == [1, 2, 4, 8], proc.stdout
    for warps, size, *layout, barrier in rows:
        assert barrier == "1", f"{warps} warps: a warp may reset the partials before another has read them"
        assert layout != ["not", "blocked"], f"{warps} warps: the ticket's layout is not a plain blocked one"
        per_thread, lanes, warps_in = (int(v) for v in layout)
        assert (lanes, warps_in) == (32, int(warps)) and int(size) % (per_thread * lanes * warps_in) == 0, \
            f"{warps} warps: a ticket of {size} elements, {per_thread}/thread, 32 lanes, {warps_in} warps has copies"


def test_gemv_fp8_batch_tiles_from_the_rule_or_the_override(monkeypatch):
    """Above batch 1 gemv_fp8 takes tiles.dot_tile's tile, an explicit argument over it, and
    OCRIAQUANT_TILE_fp8_dot_<n>x<k> over the rule."""
    import importlib

    from ocriaquant.runtime.kernels.gemv_dot import gemv_dot
    from ocriaquant.runtime.kernels.tiles import dot_tile

    gf = importlib.import_module("ocriaquant.runtime.kernels.gemv_fp8")  # the module, not the function

    seen = []
    monkeypatch.setattr(gf, "gemv_dot", lambda *a, **kw: seen.append(kw) or gemv_dot(*a, **kw))
    w_q = torch.zeros(64, 256, dtype=torch.float8_e4m3fn, device=DEV)
    x_q, x_s, w_s = torch.zeros(4, 256, dtype=torch.float8_e4m3fn, device=DEV), torch.ones(4, 1, device=DEV), \
        torch.ones(64, 1, device=DEV)
    rule = dot_tile("fp8", 64, 256, 4)
    gf.gemv_fp8(x_q, x_s, w_q, w_s)
    gf.gemv_fp8(x_q, x_s, w_q, w_s, block_k=64)
    monkeypatch.setenv("OCRIAQUANT_TILE_fp8_dot_64x256", "32,64,4,2")
    gf.gemv_fp8(x_q, x_s, w_q, w_s)
    monkeypatch.setenv("OCRIAQUANT_TILE_fp8_dot_64x256", "32,64,4,2,6")  # and the pipeline's depth
    gf.gemv_fp8(x_q, x_s, w_q, w_s)
    assert seen[0]["swap"] and {k: seen[0][k] for k in rule} == rule
    assert seen[1]["block_k"] == 64 and seen[1]["block_n"] == rule["block_n"]
    assert (seen[2]["block_n"], seen[2]["block_k"], seen[2]["num_warps"], seen[2]["split_k"]) == (32, 64, 4, 2)
    assert seen[2]["num_stages"] == 4 and seen[3]["num_stages"] == 6 and seen[3]["split_k"] == 2
    monkeypatch.setenv("OCRIAQUANT_TILE_fp8_dot_64x256", "32,64,4,2,6,1")
    with pytest.raises(ValueError, match="num_stages"):
        gf.gemv_fp8(x_q, x_s, w_q, w_s)


@pytest.mark.parametrize("m,n,k,split", [(1, 48, 512, None), (1, 40, 768, 2), (6, 32, 768, 2), (17, 16, 512, 1)])
def test_gemv_bf16(m, n, k, split):
    from ocriaquant.runtime.kernels import gemv_bf16, gemv_bf16_ref

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
    from ocriaquant.runtime.kernels import gemv_bf16, silu_mul_quant

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


@pytest.mark.parametrize("n,k", [(18432, 2560), (2560, 4096), (2560, 9216), (12352, 2560)])
def test_gemv_bf16_m1_rule_tiles(n, k):
    """The batch-1 tile tiles.m1_tile gives each of the 4B's BF16 shapes (down to 4 rows a CTA,
    8 warps on the wide K) computes the product at the shape's full K on 100 rows (ragged last
    tile); the fused gate_up (18432 rows) as the runtime runs it, with silu·mul in its epilogue."""
    from ocriaquant.runtime.kernels import gemv_bf16, gemv_bf16_ref
    from ocriaquant.runtime.kernels.tiles import m1_tile

    torch.manual_seed(n + k)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    tile = m1_tile("bf16", n, k)
    if n == 18432:
        w = torch.randn(2 * 100, k, dtype=torch.bfloat16, device=DEV) * 2 / k**0.5
        h = gemv_bf16(x, w, out=poisoned(1, 100), silu=True, **tile)
        g64, u64 = (x.double() @ w.double().T).split(100, dim=1)
        assert rel(h, g64 * g64.sigmoid() * u64) <= 1e-2
    else:
        w = torch.randn(100, k, dtype=torch.bfloat16, device=DEV) / k**0.5
        out = gemv_bf16(x, w, out=poisoned(1, 100), **tile)
        assert torch.isfinite(out).all() and rel(out, gemv_bf16_ref(x, w)) <= 1e-2


@pytest.mark.parametrize("m,i", [(1, 320), (6, 2048 + 64), (9, 96)])
def test_silu_mul_quant(m, i):
    from ocriaquant.quant import nvfp4
    from ocriaquant.runtime.kernels import silu_mul_quant, silu_mul_quant_ref

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
        from ocriaquant.runtime.kernels.gemv_nvfp4 import nvfp4_x_pairs_ref

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
    from ocriaquant.runtime.kernels import gdn_decode, gdn_decode_ref

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
    from ocriaquant.runtime.kernels import quant_fp8_per_token

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

    from ocriaquant.runtime.kernels import gdn_decode

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
    from ocriaquant.runtime.kernels import attn_decode, attn_decode_ref

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
    from ocriaquant.runtime.kernels import quant_fp8_per_token

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
    from ocriaquant.runtime.kernels import qk_norm_rope, qk_norm_rope_ref

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
    from ocriaquant.runtime.kernels import step_inputs, step_inputs_ref

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
    from ocriaquant.runtime.kernels import greedy_advance, greedy_advance_ref

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
    from ocriaquant.runtime.kernels import add_rmsnorm, add_rmsnorm_ref

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
    from ocriaquant.runtime.kernels import quant_fp8_per_token
    from ocriaquant.runtime.kernels.gemv_nvfp4 import nvfp4_x_pairs_ref

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
    from ocriaquant.runtime.kernels.gemv_nvfp4 import nvfp4_x_pairs, nvfp4_x_pairs_ref

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


def test_tile_override_replaces_the_rule_for_one_shape(monkeypatch):
    """OCRIAQUANT_TILE_<kind>_<n>x<k> (how tiles are re-swept inside the decode step) replaces the
    built-in tile of that one shape; a malformed value names the variable and the expected form."""
    from ocriaquant.runtime.kernels.tiles import dot_tile, m1_tile

    rule = m1_tile("nvfp4", 2560, 9216)
    monkeypatch.setenv("OCRIAQUANT_TILE_nvfp4_2560x9216", "32,1024,4,2")
    assert m1_tile("nvfp4", 2560, 9216) == dict(block_n=32, block_k=1024, num_warps=4, split_k=2) != rule
    assert m1_tile("fp8", 2560, 9216) != m1_tile("nvfp4", 2560, 9216)  # other kinds and shapes keep theirs
    monkeypatch.setenv("OCRIAQUANT_TILE_nvfp4_silu_18432x2560", "64,512,8")
    assert m1_tile("nvfp4_silu", 18432, 2560) == dict(block_n=64, block_k=512, num_warps=8)
    monkeypatch.setenv("OCRIAQUANT_TILE_nvfp4_2560x4096", "8,4096,4,1,168")  # NVFP4's fifth: a register cap
    assert m1_tile("nvfp4", 2560, 4096) == dict(block_n=8, block_k=4096, num_warps=4, split_k=1, maxnreg=168)
    monkeypatch.setenv("OCRIAQUANT_TILE_fp8_dot_2560x4096", "64,256,4,1,6")  # fp8_dot's: the pipeline's depth
    assert dot_tile("fp8", 2560, 4096, 32) == dict(block_n=64, block_k=256, num_warps=4, split_k=1, num_stages=6)
    for bad in ("64,512", "64,500,8", "a,b,c", "64,512,8,0", "8,4096,4,1,0", "8,4096,4,1,168,2"):
        monkeypatch.setenv("OCRIAQUANT_TILE_nvfp4_2560x9216", bad)
        with pytest.raises(ValueError, match="OCRIAQUANT_TILE_nvfp4_2560x9216"):
            m1_tile("nvfp4", 2560, 9216)
    monkeypatch.setenv("OCRIAQUANT_TILE_nvfp4_silu_18432x2560", "64,512,8,2")  # the SiLU kernel has no split
    with pytest.raises(ValueError, match="no split_k"):
        m1_tile("nvfp4_silu", 18432, 2560)


def test_pdl_only_on_the_gpu(monkeypatch):
    """PDL is a launch attribute of CUDA kernels: a CPU tensor (the interpreter, CI) never asks
    for it, whatever the caller or OCRIAQUANT_PDL say, so the kernels take their plain path there
    (every test above); on CUDA the caller's choice wins and OCRIAQUANT_PDL=0 turns the default off."""
    from ocriaquant.runtime.kernels.splitk import use_pdl

    cpu = torch.device("cpu")
    monkeypatch.setenv("OCRIAQUANT_PDL", "1")
    assert not use_pdl(cpu, None) and not use_pdl(cpu, True)
    cuda = torch.device("cuda")
    assert use_pdl(cuda, True) and not use_pdl(cuda, False)  # explicit choices need no GPU query
    monkeypatch.setenv("OCRIAQUANT_PDL", "0")
    assert not use_pdl(cuda, None)


def test_ctas_per_sm_counts_as_the_occupancy_calculator():
    """pdl_launch lets a kernel release the next one before its own wait only when its grid is one
    wave; the CTAs an SM holds are counted as NVIDIA's occupancy calculator does for compute
    capability 9.0 (65,536 registers in 256-register units per warp, 2,048 threads, 32 CTAs,
    233,472 bytes of shared memory with 1 KB reserved per CTA): worked by hand below."""
    from ocriaquant.runtime.kernels.splitk import ctas_per_sm

    assert ctas_per_sm(255, 4, 0) == 2     # 256 registers a thread: 8 warps an SM by registers
    assert ctas_per_sm(128, 8, 0) == 2     # 4,096 registers a warp: 16 warps
    assert ctas_per_sm(40, 2, 0) == 25     # 1,280 registers a warp (40 rounds to 40): 51 warps
    assert ctas_per_sm(41, 2, 0) == 21     # 41 rounds to 48: 1,536 a warp, 42 warps
    assert ctas_per_sm(16, 1, 0) == 32     # the CTA limit, before threads (64) and registers (128)
    assert ctas_per_sm(32, 16, 0) == 4     # threads: 2,048 / 512
    assert ctas_per_sm(32, 4, 51200) == 4  # shared memory: 233,472 / (51,200 + 1,024)


def test_l2_ahead_never_past_the_split_nor_under_the_interpreter():
    """The tiles the batch-1 FP8 GEMV asks L2 for before its wait: what gemv_fp8.M1_L2_AHEAD asks, cut to the
    tiles its split has after the first and to a power of two (prefetch_ahead's line count), none under the
    interpreter (the prefetch is PTX). The prefetch itself changes no output: the GPU tests compare outputs
    with it on (test_gemv_pdl_in_graph, the GEMV tests at multi-tile splits)."""
    from ocriaquant.runtime.kernels.splitk import l2_ahead

    assert [l2_ahead(False, t, 1) for t in (0, 1, 4)] == [0, 1, 1]
    assert [l2_ahead(False, t, 3) for t in (0, 1, 2, 3, 7)] == [0, 1, 2, 2, 2]
    assert l2_ahead(True, 4, 1) == 0 and l2_ahead(False, 4, 0) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch needs a CUDA GPU "
                    "(test_pdl_only_on_the_gpu covers the CPU side)")
@pytest.mark.parametrize("trigger_first", [0, 1, 2])
def test_gemv_pdl_in_graph(monkeypatch, trigger_first):
    """With PDL a GEMV starts while its producer runs and waits for it before reading x: in a
    CUDA graph behind add_rmsnorm (which releases it early) every format gives the same output
    as without PDL, replay after replay on changing inputs — also a GEMV that reads the one
    before it, and with the GEMVs releasing their own dependents before their wait
    (splitk.TRIGGER_FIRST: when their grid is one wave, or always)."""
    from ocriaquant.quant import fp8, nvfp4
    from ocriaquant.runtime.kernels import add_rmsnorm, gemv_bf16, gemv_fp8, gemv_nvfp4, splitk

    monkeypatch.setenv("OCRIAQUANT_PDL", "1")  # add_rmsnorm releases its dependents early
    monkeypatch.setattr(splitk, "TRIGGER_FIRST", trigger_first)
    n, k = 4096, 2560
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    w_sq = torch.randn(k, k, dtype=torch.bfloat16, device=DEV) / k**0.5
    w_q, w_s = fp8.quantize_weight(w)
    packed, scales, gs = nvfp4.quantize_weight(w)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    h = torch.randn(1, k, dtype=torch.bfloat16, device=DEV)
    norm_w = torch.randn(k, dtype=torch.bfloat16, device=DEV) * 0.1

    def step(pdl):
        _, y, (q, s, half) = add_rmsnorm(x, h, norm_w, 1e-6, quant="fp8")
        _, _, pairs = add_rmsnorm(x, h, norm_w, 1e-6, quant="nvfp4")
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
