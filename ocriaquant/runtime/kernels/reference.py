"""Plain-torch references of the decode kernels, one `<kernel>_ref` per launcher: what the tests
compare each kernel against (most in float64), and the torch ops the torch backend runs. No
Triton here, and nothing of ours outside kernels/: the torch backend imports this module where
Triton is not installed.

The quantized formats' numerics (compressed-tensors 0.19 on BF16 tensors, as ocriaquant.quant
computes them) are written out below in the few lines the references need, so that this module
stays a leaf; tests/test_kernels.py checks them bit for bit against ocriaquant.quant.
- FP8 E4M3, per-token dynamic: scale = absmax / 448 in the activation's dtype (0 becomes that
  dtype's eps), codes = E4M3(clamp(x / scale, ±448)).
- NVFP4: E2M1 values, one E4M3 scale per 16 values along K, an FP32 global scale. Block scale =
  E4M3(global · (block absmax / 6)), the division in the values' dtype, the product in fp32 (a
  zero block gets 0.125); value = E2M1(x / (scale / global)) in fp32, ties to even, the sign kept
  (-0.1 packs as -0); two values a byte, the even index in the low nibble, nibble = sign << 3 |
  index into E2M1_VALUES. Dequantized: E2M1 (bf16) · (scale (bf16) / global) in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .partials import Partials

FP8_MAX = 448.0
FP4_MAX = 6.0
NVFP4_BLOCK = 16
NVFP4_ZERO_SCALE = 0.125  # the E4M3 eps compressed-tensors gives a zero block's scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# --- quantized formats ------------------------------------------------------------------------

def fp8_quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic FP8 over the last dim: (E4M3 codes like x, scale [..., 1] in x's dtype)."""
    scale = x.abs().amax(-1, keepdim=True) / torch.tensor(FP8_MAX, dtype=x.dtype, device=x.device)
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    # "+ 0.0": -0.0 becomes +0.0, as compressed-tensors' zero-point addition makes it
    return torch.clamp(x / scale + 0.0, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_fake_quant_per_token(x: torch.Tensor) -> torch.Tensor:
    """fp8_quantize_per_token, dequantized, in x's dtype."""
    q, scale = fp8_quantize_per_token(x)
    return q.to(x.dtype) * scale


def _nvfp4_blocks(x: torch.Tensor, global_scale: torch.Tensor):
    """(x as [..., K/16, 16], E4M3-valued fp32 block scales [..., K/16], the fp32 global scale [1])."""
    k = x.shape[-1]
    if k % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs the last dim to be a multiple of {NVFP4_BLOCK}, got {k}")
    g = x.unflatten(-1, (k // NVFP4_BLOCK, NVFP4_BLOCK))
    gs = global_scale.reshape(1).to(device=x.device, dtype=torch.float32)
    local = g.abs().amax(-1) / torch.tensor(FP4_MAX, dtype=g.dtype, device=g.device)
    s = torch.clamp(gs * local, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return g, torch.where(s == 0, NVFP4_ZERO_SCALE, s), gs


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """fp32 values -> E2M1 nibbles (int64): nearest grid value, ties to even (up at 0.75, 1.75 and 3.5,
    down at 0.25, 1.25, 2.5 and 5), saturating at 6, the sign bit kept."""
    a = v.abs()
    idx = ((a > 0.25).long() + (a >= 0.75).long() + (a > 1.25).long() + (a >= 1.75).long()
           + (a > 2.5).long() + (a >= 3.5).long() + (a > 5.0).long())
    return idx | (torch.signbit(v).long() << 3)


def _e2m1_values(nib: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    vals = torch.tensor(E2M1_VALUES, device=nib.device)[nib & 7]
    return torch.where((nib & 8) != 0, -vals, vals).to(dtype)


def nvfp4_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] under a given global scale -> (packed uint8 [..., K/2], E4M3 block scales [..., K/16])."""
    g, s, gs = _nvfp4_blocks(x, global_scale)
    nib = _e2m1_codes(g / (s / gs).unsqueeze(-1) + 0.0).flatten(-2)
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8), s.to(torch.float8_e4m3fn)


def nvfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed uint8 [..., K/2], E4M3 scales [..., K/16], fp32 global scale [1] -> the values [..., K] in dtype."""
    b = packed.long()
    nib = torch.stack([b & 15, b >> 4], -1).flatten(-2)
    vals = _e2m1_values(nib, torch.bfloat16).unflatten(-1, (-1, NVFP4_BLOCK))
    out = vals * (scales.to(torch.bfloat16) / global_scale.reshape(1).float()).unsqueeze(-1)
    return out.flatten(-2).to(dtype)


def nvfp4_fake_quant(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """nvfp4_quantize, dequantized, in x's dtype (W4A4's activations: block scales from x, global static)."""
    g, s, gs = _nvfp4_blocks(x, global_scale)
    step = (s / gs).unsqueeze(-1)
    return (_e2m1_values(_e2m1_codes(g / step + 0.0), torch.float32) * step).flatten(-2).to(x.dtype)


# --- kernel references ------------------------------------------------------------------------

def add_rmsnorm_ref(x: torch.Tensor, h: torch.Tensor | Partials | None, weight: torch.Tensor, eps: float):
    """The torch ops the runtime's torch backend runs (layers.RMSNorm after a bf16 add)."""
    if isinstance(h, Partials):  # the bf16 output the GEMV's own reduction would have written: in split order
        total = h.parts[0].clone()
        for part in h.parts[1:]:
            total += part
        h = total.to(x.dtype)
    r = x + h if h is not None else x
    t = r.float()
    t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
    return r, (t * (1.0 + weight.float())).type_as(r)


def gated_rmsnorm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNormGated over rows of V: the norm in fp32, the weight multiplied in the input
    dtype, then silu(gate) in fp32, rounded once (the torch backend's layers.gated_rmsnorm)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)


def vision_rope_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int):
    """transformers' vision attention up to SDPA: qkv [S, 3·H·D] -> q, k, v [1, H, S, D], q and k
    rotated in fp32 (x·cos + rotate_half(x)·sin, apply_rotary_pos_emb_vision) and rounded once."""
    S = qkv.shape[0]
    q, k, v = qkv.reshape(S, 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = cos[:, None].float(), sin[:, None].float()

    def rotate(x):
        x = x.float()
        x1, x2 = x.chunk(2, -1)
        return (x * cos + torch.cat((-x2, x1), -1) * sin).to(qkv.dtype)

    return tuple(t.transpose(0, 1)[None].contiguous() for t in (rotate(q), rotate(k), v))


def depthwise_causal_conv_silu(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[.., C, kernel] windows · [C, kernel] weights -> silu(conv) in the input dtype: the sum in
    fp32, rounded, then SiLU. The same sum F.conv1d computes, written out: on the CPU a depthwise
    F.conv1d in BF16 falls to a per-channel slow path (about 1 s per decode step of the bundled model)."""
    y = (window.float() * weight.float()).sum(-1).to(window.dtype)
    return F.silu(y)


def conv_silu_ref(x: torch.Tensor, history: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """A GDN prefill chunk's causal depthwise conv + SiLU over rows x [n, C] with the slot's last K-1
    inputs (history [C, K-1]; None: zeros) -> [n, C]: what the torch backend runs."""
    k = weight.shape[-1]
    history = x.new_zeros(x.shape[1], k - 1) if history is None else history
    padded = torch.cat([history.to(x.dtype), x.T], dim=1)  # [C, K-1+n]
    return depthwise_causal_conv_silu(padded.unfold(1, k, 1), weight[:, None, :]).T.contiguous()


def attn_decode_ref(q, k_cache, v_cache, slots, lengths, scale, dtype=torch.float64, gate=None):
    """Plain torch, row by row in `dtype`: softmax over the visible prefix of the row's slot,
    times sigmoid(gate) if given."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    g = q.shape[1] // k_cache.shape[1]
    for i, (s, n) in enumerate(zip(slots.tolist(), lengths.tolist())):
        k = k_cache[s, :, : n + 1].to(dtype).repeat_interleave(g, 0)  # [heads, n+1, hd]
        v = v_cache[s, :, : n + 1].to(dtype).repeat_interleave(g, 0)
        p = torch.softmax(torch.einsum("hd,htd->ht", q[i].to(dtype), k) * scale, -1)
        out[i] = torch.einsum("ht,htd->hd", p, v)
    return out if gate is None else out * torch.sigmoid(gate.to(dtype))


def gdn_decode_ref(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, norm_weight, state, slots,
                   num_k_heads: int, head_k_dim: int, head_v_dim: int, eps: float = 1e-6, dtype=torch.float64):
    """Plain torch, the same step written the way transformers writes it (state as [V, K] per
    head), in `dtype`. Returns (out, new conv_state, new state) without touching the inputs."""
    H, K, V = num_k_heads, head_k_dim, head_v_dim
    hv = A_log.shape[0]
    kw = conv_weight.shape[-1]
    cw = conv_weight.reshape(-1, kw).to(dtype)
    conv_state, state = conv_state.clone(), state.clone()
    out = torch.zeros(qkv.shape[0], hv * V, dtype=dtype, device=qkv.device)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        win = torch.cat([conv_state[s].to(dtype), qkv[i].to(dtype)[:, None]], dim=1)  # [C, KW]
        conv_state[s] = win[:, 1:].to(conv_state.dtype)
        x = F.silu((win * cw).sum(1))
        q, k, v = x.split([H * K, H * K, hv * V])
        q, k, v = q.view(H, K), k.view(H, K), v.view(hv, V)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / K**0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        q, k = q.repeat_interleave(hv // H, 0), k.repeat_interleave(hv // H, 0)
        g = -A_log.to(dtype).exp() * F.softplus(a[i].to(dtype) + dt_bias.to(dtype))
        beta = torch.sigmoid(b[i].to(dtype))
        S = state[s].to(dtype) * g.exp()[:, None, None]                        # [HV, V, K]
        delta = (v - torch.einsum("hvk,hk->hv", S, k)) * beta[:, None]
        S = S + delta[:, :, None] * k[:, None, :]
        state[s] = S.to(state.dtype)
        o = torch.einsum("hvk,hk->hv", S, q)
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + eps) * norm_weight.to(dtype)
        out[i] = (o * F.silu(z[i].to(dtype).view(hv, V))).flatten()
    return out, conv_state, state


def gemv_bf16_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Plain torch, float64: the exact product."""
    return x.double() @ w.double().T


def gemv_fp8_ref(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Plain torch, float64: the exact product of the dequantized operands."""
    x = x_q.double() * x_scale.double()
    w = w_q.double() * w_scale.double()
    return x @ w.T


def gemv_nvfp4_ref(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                   w_global_scale: torch.Tensor) -> torch.Tensor:
    """Plain torch, float64: x times the weight dequantized to bf16 (nvfp4_dequantize, the simulation's)."""
    w = nvfp4_dequantize(w_packed, w_scale, w_global_scale, torch.bfloat16)
    return x.double() @ w.double().T


def gemv_nvfp4_silu_ref(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                        w_global_scale: torch.Tensor) -> torch.Tensor:
    """Plain torch, float64: silu(gate) · up of a fused gate_up (rows [gate; up], not
    interleaved), what gemv_nvfp4_silu's activation pairs hold up to bf16 and fp16 rounding."""
    gate, up = gemv_nvfp4_ref(x, w_packed, w_scale, w_global_scale).chunk(2, dim=-1)
    return F.silu(gate) * up


def nvfp4_x_pairs_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: nvfp4_x_pairs' words and scales (the scaling, fp16 rounding and order of
    half2.nvfp4_pairs, written independently: exponents from frexp, powers of two built from
    their bits, so that no log2 or pow rounding on any device can move them)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 16, 16)
    amax = blocks.abs().amax(-1)
    e = (torch.frexp(amax)[1].long() - 1).where(amax >= 2.0 ** -126, torch.tensor(-100, device=x.device))
    e = e.clamp(min=-100)

    def pow2(n):
        return ((n + 1023) << 52).view(torch.float64)

    h = (blocks.double() * pow2(14 - e)[..., None]).to(torch.float16)
    order = [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]  # (lo, hi) of words 0..7
    words = h[..., order].contiguous().view(torch.int32).reshape(m, k // 2)
    return words, pow2(e).float()


def greedy_advance_ref(logits, tokens, slots, lengths, sentinel) -> torch.Tensor:
    """The torch ops the runtime ran before this kernel (model_runner's _advance)."""
    nxt = logits.argmax(-1)
    tokens.copy_(nxt)
    lengths.add_(slots != sentinel)
    return nxt


def qk_norm_rope_ref(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots, lengths):
    """The torch ops the torch backend runs (layers.RMSNorm, transformers' apply_rotary_pos_emb,
    an index_put into the cache); writes the caches like the kernel and returns q."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    def norm(x, w):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * (1.0 + w.float())).type_as(x)

    bsz, heads, hd = q.shape
    qn = norm(q, q_weight)[:, :, None]                                          # [B, heads, 1, hd]
    kn = norm(k.reshape(bsz, -1, hd), k_weight)[:, :, None]
    qr, kr = apply_rotary_pos_emb(qn, kn, cos[:, None], sin[:, None], unsqueeze_dim=1)
    k_cache[slots.long(), :, lengths.long()] = kr[:, :, 0]
    v_cache[slots.long(), :, lengths.long()] = v.reshape(bsz, -1, hd)
    return qr[:, :, 0]


def silu_mul_quant_ref(gate: torch.Tensor, up: torch.Tensor, fmt: str = "fp8",
                       input_global_scale: torch.Tensor | None = None):
    """The unfused torch sequence with compressed-tensors-exact numerics (the helpers above):
    bf16 the product; fp8 (codes, fp32 scale [M, 1]); nvfp4 (packed, E4M3 scales)."""
    h = F.silu(gate) * up
    if fmt == "bf16":
        return h
    if fmt == "fp8":
        q, scale = fp8_quantize_per_token(h)
        return q, scale.float()
    return nvfp4_quantize(h, input_global_scale)


def step_inputs_ref(tokens, slots, lengths, deltas, embed, rotary, dtype) -> tuple[torch.Tensor, ...]:
    """What the torch backend computes each step: the embedding, the rotary module at
    (length + delta) in all three sections, int32 copies."""
    pos = (lengths + deltas)[None].expand(3, -1)
    cos, sin = rotary(torch.empty(0, dtype=dtype, device=tokens.device), pos[:, None, :])
    return (F.embedding(tokens, embed), cos[0], sin[0], slots.to(torch.int32), lengths.to(torch.int32))


def gdn_verify_ref(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, norm_weight, state, slots,
                   num_k_heads: int, head_k_dim: int, head_v_dim: int, eps: float = 1e-6, accepted=None,
                   dtype=torch.float64):
    """Speculative verify then commit, as T sequential gdn_decode_ref steps in `dtype` (the recurrent state
    carried in `dtype` between steps): qkv [B, T, C], z [B, T, HV·V], a, b [B, T, HV]. Returns (out
    [B, T, HV·V], conv_state, state): every position's output, and the buffers as if each row had decoded only
    its first accepted[b] tokens (all T where accepted is None; padding rows, slot < 0, touch nothing). The
    inputs are not touched; the state comes back in `dtype`, the conv state in its own dtype."""
    bsz, T = qkv.shape[:2]
    n = [T] * bsz if accepted is None else [int(v) for v in accepted.tolist()]
    conv_live, state_live = conv_state.clone(), state.to(dtype, copy=True)
    conv_out, state_out = conv_state.clone(), state.to(dtype, copy=True)
    outs = []
    for t in range(T):
        o, conv_live, state_live = gdn_decode_ref(qkv[:, t], z[:, t], a[:, t], b[:, t], conv_live, conv_weight, A_log,
                                                  dt_bias, norm_weight, state_live, slots, num_k_heads, head_k_dim,
                                                  head_v_dim, eps, dtype)
        outs.append(o)
        for i, s in enumerate(slots.tolist()):
            if s >= 0 and n[i] == t + 1:
                conv_out[s], state_out[s] = conv_live[s], state_live[s]
    return torch.stack(outs, 1), conv_out, state_out
