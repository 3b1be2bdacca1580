"""FP8 / NVFP4 numerics, bit-exact against compressed-tensors 0.19 as llmcompressor drives it."""

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize, quantize
from compressed_tensors.quantization.utils import calculate_qparams, compute_dynamic_scales_and_zp, generate_gparam

from ocriaquant.quant import fp8, nvfp4

NVFP4 = preset_name_to_scheme("NVFP4", ["Linear"])
FP8 = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
N_CASES = 1000


def _tensor(gen: torch.Generator, i: int, shape, dtype=torch.bfloat16) -> torch.Tensor:
    """Random tensors spanning what real weights and activations hold, and the corner cases."""
    kind = i % 10
    x = torch.randn(shape, generator=gen)
    mag = 10 ** (torch.rand((), generator=gen) * 12 - 6)  # 1e-6 .. 1e6
    if kind == 0:
        x = x * 1e-38  # bf16 subnormals
    elif kind == 1:
        x = x * 3e37  # near the top of the range
    elif kind == 2:
        x = torch.where(torch.rand(shape, generator=gen) < 0.5, torch.zeros(shape), x)  # many zeros
    elif kind == 3:
        x = torch.zeros(shape)
        if i % 20 == 3:
            x = -x  # all -0.0
    elif kind == 4:
        x = torch.where(torch.rand(shape, generator=gen) < 0.3, -torch.zeros(shape), x) * mag
    elif kind == 5:
        x = x.exp() * mag  # heavy tail, all positive
    elif kind == 6:
        x = torch.randint(-12, 13, shape, generator=gen).float() / 2  # values on ties of the grids
    elif kind == 7:
        x = x * mag
        x.view(-1)[:: max(1, x.numel() // 3)] *= 1000  # outliers
    else:
        x = x * mag
    return x.to(dtype)


def _shape(gen, i, multiple=1):
    out = int(torch.randint(1, 40, (), generator=gen))
    k = int(torch.randint(1, 12, (), generator=gen)) * 16 if multiple == 16 else int(torch.randint(1, 200, (), generator=gen))
    return out, k


def ct_nvfp4_weight(w: torch.Tensor, absmax: torch.Tensor | None = None):
    """What llmcompressor writes for an NVFP4 Linear: min/max observer per 16-group in the
    weight's dtype, generate_gparam, calculate_qparams, then the NVFP4 compressor's quantize+pack."""
    args = NVFP4.weights
    g = w.unflatten(-1, (w.shape[-1] // 16, 16))
    mn, mx = g.amin(-1), g.amax(-1)
    if absmax is None:
        absmax = torch.max(mx.max(), -mn.min())
    gs = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    scale, zp = calculate_qparams(mn, mx, args, global_scale=gs)
    scale = scale.to(w.dtype)  # held in a parameter of the weight's dtype
    q = quantize(x=w, scale=scale, zero_point=zp, args=args, global_scale=gs)
    return pack_fp4_to_uint8(q), scale.to(torch.float8_e4m3fn), gs


def ct_fp8_weight(w: torch.Tensor):
    args = FP8.weights
    mn, mx = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    scale, zp = calculate_qparams(mn, mx, args)
    return quantize(x=w, scale=scale, zero_point=zp, args=args, dtype=torch.float8_e4m3fn), scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.uint8) else t.float().view(torch.int32)


def test_fp8_weight_bit_exact():
    gen = torch.Generator().manual_seed(0)
    for i in range(N_CASES):
        dtype = torch.float32 if i % 7 == 0 else torch.bfloat16
        w = _tensor(gen, i, _shape(gen, i), dtype)
        q, s = fp8.quantize_weight(w)
        q_ref, s_ref = ct_fp8_weight(w)
        assert s.dtype == s_ref.dtype and torch.equal(_bits(s), _bits(s_ref)), i
        assert torch.equal(_bits(q), _bits(q_ref)), i
        assert torch.equal(fp8.dequantize(q, s, w.dtype), dequantize(q_ref, s_ref, args=FP8.weights, dtype=w.dtype))


def test_nvfp4_weight_bit_exact():
    gen = torch.Generator().manual_seed(1)
    for i in range(N_CASES):
        dtype = torch.float32 if i % 7 == 0 else torch.bfloat16
        w = _tensor(gen, i, _shape(gen, i, 16), dtype)
        packed, scales, gs = nvfp4.quantize_weight(w)
        p_ref, s_ref, gs_ref = ct_nvfp4_weight(w)
        assert torch.equal(_bits(gs), _bits(gs_ref)), i
        assert torch.equal(_bits(scales), _bits(s_ref)), i
        assert torch.equal(packed, p_ref), (i, w, packed, p_ref)
        m, n = w.shape
        ref_deq = dequantize(x_q=unpack_fp4_from_uint8(p_ref, m, n), scale=s_ref.to(torch.bfloat16),
                             args=NVFP4.weights, global_scale=gs_ref, dtype=torch.bfloat16)
        assert torch.equal(_bits(nvfp4.dequantize(packed, scales, gs)), _bits(ref_deq)), i


def test_nvfp4_fused_units_share_global_scale():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    k = (torch.randn(16, 32, generator=gen) * 5).to(torch.bfloat16)
    gs = nvfp4.global_scale(q, k)
    absmax = torch.max(q.abs().amax(), k.abs().amax())
    for w in (q, k):
        packed, scales, gs_out = nvfp4.quantize_weight(w, gs)
        p_ref, s_ref, gs_ref = ct_nvfp4_weight(w, absmax)
        assert torch.equal(gs_out, gs_ref) and torch.equal(packed, p_ref) and torch.equal(_bits(scales), _bits(s_ref))


def test_pack_unpack_match_compressed_tensors():
    gen = torch.Generator().manual_seed(3)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    for i in range(200):
        m, n = int(torch.randint(1, 30, (), generator=gen)), 2 * int(torch.randint(1, 60, (), generator=gen))
        vals = grid[torch.randint(0, 8, (m, n), generator=gen)] * (torch.randint(0, 2, (m, n), generator=gen) * 2 - 1)
        vals = vals.to(torch.bfloat16)
        assert torch.equal(nvfp4.pack(vals), pack_fp4_to_uint8(vals))
        packed = pack_fp4_to_uint8(vals)
        assert torch.equal(nvfp4.unpack(packed), unpack_fp4_from_uint8(packed, m, n))


def test_e2m1_rounding_matches_on_every_tie_and_sign():
    from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA

    x = torch.arange(-1400, 1401, dtype=torch.float32) / 200  # -7 .. 7 in steps of 0.005, all ties included
    ref = FP4_E2M1_DATA.cast_to_fp4(torch.clamp(x, -6, 6))
    ours = nvfp4.round_to_e2m1(x)
    assert torch.equal(ours, ref)
    assert torch.equal(torch.signbit(ours), torch.signbit(ref))


def test_fp8_activation_fake_quant_matches():
    gen = torch.Generator().manual_seed(4)
    for i in range(200):
        x = _tensor(gen, i, (2, int(torch.randint(1, 9, (), generator=gen)), 48))
        scale, zp = compute_dynamic_scales_and_zp(x, FP8.input_activations, module=None)
        ref = fake_quantize(x, scale, zp, FP8.input_activations)
        assert torch.equal(_bits(fp8.fake_quant_activation(x)), _bits(ref)), i


def test_nvfp4_activation_fake_quant_matches():
    gen = torch.Generator().manual_seed(5)
    args = NVFP4.input_activations
    for i in range(200):
        x = _tensor(gen, i, (2, int(torch.randint(1, 9, (), generator=gen)), 64))
        if i % 10 in (0, 3):
            continue  # an all-zero or subnormal calibration gives no meaningful global scale
        absmax = x.abs().amax()
        gs = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
        scale, zp = compute_dynamic_scales_and_zp(x, args, module=None, global_scale=gs)
        ref = fake_quantize(x, scale, zp, args, global_scale=gs)
        ours = nvfp4.fake_quant_activation(x, nvfp4.global_scale_from_absmax(absmax))
        assert torch.equal(_bits(ours), _bits(ref)), i


def test_errors_name_the_tensor_and_the_fix():
    w = torch.ones(4, 32)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="layers.0.mlp.up_proj.*NaN"):
        nvfp4.quantize_weight(w, name="layers.0.mlp.up_proj")
    w[1, 3] = float("inf")
    with pytest.raises(ValueError, match="q_proj.*NaN/Inf"):
        fp8.quantize_weight(w, name="q_proj")
    with pytest.raises(ValueError, match="multiple of 16.*BF16 or FP8"):
        nvfp4.quantize_weight(torch.ones(4, 24), name="odd")
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_weight(torch.ones(4))
    with pytest.raises(ValueError, match="even"):
        nvfp4.pack(torch.ones(2, 3))


def test_quantization_error_is_bounded():
    """Independent of compressed-tensors: relative error bounds that follow from the formats."""
    w = torch.randn(256, 512, dtype=torch.float64).to(torch.float32)
    e8 = (fp8.fake_quant_weight(w) - w).abs() / w.abs().amax(1, keepdim=True)
    assert e8.max() < 2 ** -4  # E4M3: 3 mantissa bits, half an ulp of the row max at most
    e4 = (nvfp4.fake_quant_weight(w) - w).norm() / w.norm()
    assert 0.05 < e4 < 0.15  # 16-element E2M1 blocks: ~10% RMS error on Gaussian weights


def test_simulation_is_exact_reversible_and_leaves_tied_embeddings_alone(tiny_model_dir):
    from ocriaquant.model import discover_groups, load_model
    from ocriaquant.quant.simulate import simulate

    model, _ = load_model(tiny_model_dir, dtype="bf16")
    groups = {g.name: g for g in discover_groups(model)}
    embed = model.get_input_embeddings().weight
    assert model.lm_head.weight is embed  # tied, as in Qwen3.5-4B
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    up = groups["layers.0.mlp_up"]
    units = [(up.members, "w4a16"), (["lm_head"], "fp8"), (groups["layers.3.attn_qkv"].members, "w4a4")]
    with simulate(model, units):
        gate, upm = (model.get_submodule(m) for m in up.members)
        gs = nvfp4.global_scale(before[up.members[0] + ".weight"], before[up.members[1] + ".weight"])
        assert torch.equal(gate.weight, nvfp4.fake_quant_weight(before[up.members[0] + ".weight"], gs))
        assert torch.equal(model.lm_head.weight, fp8.fake_quant_weight(before["model.language_model.embed_tokens.weight"]))
        assert torch.equal(model.get_input_embeddings().weight, before["model.language_model.embed_tokens.weight"])
        x = torch.randn(1, 3, model.lm_head.in_features, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(fp8.fake_quant_activation(x), model.lm_head.weight)
        assert torch.equal(model.lm_head(x), ref)  # the pre-hook quantizes activations per token
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert model.lm_head.weight is model.get_input_embeddings().weight
    x = torch.randn(1, 3, model.lm_head.in_features, dtype=torch.bfloat16)
    assert torch.equal(model.lm_head(x), torch.nn.functional.linear(x, before["model.language_model.embed_tokens.weight"]))
