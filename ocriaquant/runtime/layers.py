"""The Qwen3.5 text decoder, written for serving: QuantLinear per format, GDN and gated
attention layers whose state lives in per-slot buffers, the MLP.

Backend `torch` is the reference path: every op is the one
transformers runs, in the same dtype, so greedy tokens match transformers' (tests). The
gated delta rule calls transformers' own torch functions (chunked for prefill, recurrent
for decode): the same math, now fed from and written back to our slot buffers. Backend
`triton` runs decode steps through runtime/kernels/: gdn_decode for the GDN layers,
qk_norm_rope and attn_decode (output gate included) for attention, the weight-streaming
GEMVs for every Linear (M <= 64), silu_mul_quant between gate/up and down_proj. Prefill
stays on the torch path.

State layouts (DESIGN.md): GDN recurrent state fp32 [slots, HV, V, K] — transformers keeps
[.., K, V], so it is transposed on the way in and out —, conv state [slots, C, kernel-1],
attention KV cache [slots, KV heads, max_len, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..quant import fp8, nvfp4
from .partials import Partials

KINDS = ("bf16", "fp8", "nvfp4", "nvfp4_w4a4")


@dataclass
class Step:
    """Per-step batch metadata, built once per decode step and shared by every layer."""
    slots: torch.Tensor          # int64 [B]
    lengths: torch.Tensor        # int64 [B]: tokens already cached = position of the new token
    cos: torch.Tensor            # [B, rot] M-RoPE
    sin: torch.Tensor
    slots32: torch.Tensor        # int32 copies, what the kernels take
    lengths32: torch.Tensor
    span: int = 0                # torch backend only: max(lengths) + 1 (a host sync)


class QuantLinear(nn.Module):
    """A Linear in one of our formats. The torch backend computes with the dequantized weight
    (exactly compressed-tensors' decompression) and, for W8A8 / W4A4, fake-quantized inputs,
    which is what transformers does with the same checkpoint; the packed tensors are kept for
    the Triton kernels."""

    def __init__(self, kind: str, weight: torch.Tensor, scale: torch.Tensor | None = None,
                 global_scale: torch.Tensor | None = None, input_global_scale: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown QuantLinear kind {kind!r}; one of {KINDS}")
        self.kind = kind
        # A buffer, so it moves with the module and the forward needs no per-call .to(device).
        self.register_buffer("input_global_scale", input_global_scale)
        if kind == "bf16":
            w = weight.to(dtype)
        elif kind == "fp8":
            self.register_buffer("w_q", weight)
            self.register_buffer("w_scale", scale)
            w = fp8.dequantize(weight, scale).to(dtype)
        else:
            self.register_buffer("w_packed", weight)
            self.register_buffer("w_scale", scale)
            self.register_buffer("w_global_scale", global_scale.reshape(1).float())
            w = nvfp4.dequantize(weight, scale, global_scale.reshape(1).float(), dtype)
        self.register_buffer("weight", w)
        self.out_features, self.in_features = w.shape
        self._m1_tiles: dict[str, dict] = {}  # the batch-1 GEMV tiles by kernel kind (_m1_tile), on first use
        self._dot_tiles: dict[int, dict] = {}  # FP8 above batch 1: the tensor-core GEMV's tile by batch (_dot_tile)
        self.register_buffer("w_m1", None)  # NVFP4: the batch-1 kernel's weight words (pack_m1)
        self.register_buffer("w_m1_scale", None)
        self.m1_interleaved = False

    def pack_m1(self, interleave: bool = False) -> None:
        """NVFP4: write the weight once more in the batch-1 kernel's bit order (gemv_nvfp4.pack_m1),
        on the weight's device; interleave: a fused gate_up whose batch-1 output is silu(gate) · up
        (MLP.forward). Called by RuntimeModel for the triton backend, before any CUDA graph."""
        from .kernels.gemv_nvfp4 import pack_m1

        words, scales = pack_m1(self.w_packed, self.w_scale, interleave)
        self.w_m1, self.w_m1_scale = words, scales
        self.m1_interleaved = interleave

    triton = False  # set by RuntimeModel(backend="triton")

    def uses_kernels(self, x: torch.Tensor) -> bool:
        """The GEMV kernels take decode-sized BF16 rows (M <= 64); all else is torch."""
        return self.triton and x.ndim >= 2 and x.numel() // x.shape[-1] <= 64 and x.dtype == torch.bfloat16

    def producer_quant(self, x: torch.Tensor) -> str | None:
        """The form in which a producer that can quantize (gdn_decode, attn_decode: their `quant`)
        should hand this Linear its input x: None when this is not an FP8 GEMV on the kernels;
        "fp8" above batch 1, the codes and scale, made by the producer; "amax" at batch 1, the row's
        absmax in parts, and the GEMV quantizes its own slices (gemv_fp8_quantizing)."""
        if self.kind != "fp8" or not self.uses_kernels(x):
            return None
        return "fp8" if x.shape[0] > 1 else "amax"

    def forward(self, x: torch.Tensor, x_q: tuple | None = None, partials: bool = False):
        """x_q: x already in the form this Linear's GEMV reads, written by the producer
        (add_rmsnorm, silu_mul_quant): for FP8 (E4M3, scale[, fp16 pairs at M = 1]) or, at M = 1,
        (x's absmax in parts,) (gdn_decode's quant="amax"), for NVFP4 at M = 1 (words, block
        scales) (kernels/half2.py). The kernel path uses it instead of
        converting x again; the torch path ignores it. partials: the caller hands the output to
        add_rmsnorm, so a batch-1 GEMV that splits K may return its splits unreduced
        (runtime/partials.py; the decode step's residual producers)."""
        if self.uses_kernels(x):
            y = self.forward_kernels(x.reshape(-1, x.shape[-1]), x_q, partials)
            return y if isinstance(y, Partials) else y.reshape(*x.shape[:-1], -1)
        if self.kind == "fp8":
            x = fp8.fake_quant_activation(x)
        elif self.kind == "nvfp4_w4a4":
            x = nvfp4.fake_quant_activation(x, self.input_global_scale)
        return F.linear(x, self.weight)

    def forward_kernels(self, x: torch.Tensor, x_q: tuple | None = None, partials: bool = False):
        """Decode (M <= 64): FP8 through gemv_fp8 at every M; BF16 and NVFP4 through their
        weight-streaming GEMVs at M = 1, cuBLAS above. `x_q`, `partials`: see forward."""
        from .kernels import gemv_bf16, gemv_fp8, gemv_fp8_quantizing, gemv_nvfp4, quant_fp8_per_token

        m = x.shape[0]
        tile = self._m1_tile() if m == 1 else self._dot_tile(m) if self.kind == "fp8" else {}
        # x_q's first item tells its form: E4M3 codes for FP8, int32 words for NVFP4 pairs, fp32 for
        # x's absmax in parts (batch 1, FP8: quantized inside the GEMV)
        form = None if x_q is None else x_q[0].dtype
        if self.kind == "fp8" and form == torch.float32 and m == 1:
            return gemv_fp8_quantizing(x, x_q[0], self.w_q, self.w_scale, partials=partials,
                                       **self._m1_tile("fp8_qx"))
        if self.kind == "fp8":
            q, s, *half = x_q if form == torch.float8_e4m3fn else quant_fp8_per_token(x.contiguous(), half=m == 1)
            return gemv_fp8(q, s, self.w_q, self.w_scale, x_half=half[0] if half else None, partials=partials, **tile)
        if self.kind == "nvfp4_w4a4":  # no W4A4 kernel on Hopper: emulate the activation rounding
            x = nvfp4.fake_quant_activation(x, self.input_global_scale)
        if m > 1:  # BF16 and W4A16 above batch 1: cuBLAS on the dequantized weight was faster on the H200
            return F.linear(x, self.weight)  # (BENCHMARKS.md: M = 8 and 64), and computes the same values
        if self.kind == "bf16":
            return gemv_bf16(x.contiguous(), self.weight, **tile)
        return gemv_nvfp4(x.contiguous(), self.w_packed, self.w_scale, self.w_global_scale,
                          x_pairs=x_q if form == torch.int32 else None, m1=self._m1(), partials=partials, **tile)

    def _m1_tile(self, kind: str | None = None) -> dict:
        """The batch-1 GEMV tile (kernels/tiles.py) for this weight's shape and `kind` (this
        Linear's format; "nvfp4_silu": gemv_nvfp4_silu), looked up once."""
        kind = kind or self.kind
        if kind not in self._m1_tiles:
            from .kernels.tiles import m1_tile

            self._m1_tiles[kind] = m1_tile(kind, self.out_features, self.in_features)
        return self._m1_tiles[kind]

    def _dot_tile(self, m: int) -> dict:
        """The FP8 tensor-core GEMV's tile at batch m > 1 (kernels/tiles.dot_tile), looked up once per m."""
        if m not in self._dot_tiles:
            from .kernels.tiles import dot_tile

            self._dot_tiles[m] = dot_tile(self.kind, self.out_features, self.in_features, m)
        return self._dot_tiles[m]

    def forget_tiles(self) -> None:
        """Drop the tiles looked up so far (_m1_tile, _dot_tile): the next launch reads tiles.py's
        rule and overrides again (scripts/ab_step.py, between variants of a model built once)."""
        self._m1_tiles.clear()
        self._dot_tiles.clear()

    def tile_kinds(self) -> list[str]:
        """The kinds (tiles.tile_override's) of the tiles looked up so far: the batch-1 kernels'
        and, once a batch above 1 ran, "<kind>_dot"."""
        return list(self._m1_tiles) + ([f"{self.kind}_dot"] if self._dot_tiles else [])

    def _m1(self) -> tuple | None:
        if self.m1_interleaved:  # its rows are reordered for gemv_nvfp4_silu, which MLP calls
            raise RuntimeError("this gate_up's batch-1 weight is interleaved for the fused SiLU; use MLP")
        return None if self.w_m1 is None else (self.w_m1, self.w_m1_scale)

    def forward_silu_pairs(self, x_pairs: tuple) -> tuple:
        """Batch 1, NVFP4 gate_up packed with interleave: silu(gate) · up as down_proj's activation
        pairs, from this GEMV's epilogue (gemv_nvfp4_silu)."""
        from .kernels.gemv_nvfp4 import gemv_nvfp4_silu

        return gemv_nvfp4_silu(x_pairs, (self.w_m1, self.w_m1_scale), self.w_global_scale,
                               **self._m1_tile("nvfp4_silu"))

    def forward_silu_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """Batch 1, a BF16 fused gate_up: silu(gate) · up [1, I] from the GEMV's epilogue
        (gemv_bf16 silu), the launch of silu_mul_quant saved. The tile is the unfused GEMV's, so a CTA
        streams that many gate rows and as many up rows: on an H200 the BF16 step took 2.789 ms at
        batch 1 with it, 2.829 with half as many rows of each, 2.875 unfused (session 12)."""
        from .kernels import gemv_bf16

        return gemv_bf16(x, self.weight, silu=True, **self._m1_tile())

    def forward_pairs(self, x_pairs: tuple, partials: bool = False):
        """Batch 1, NVFP4 (W4A16): y [1, N] from activations that arrive as pairs only
        (`partials`: see forward)."""
        from .kernels import gemv_nvfp4

        return gemv_nvfp4(None, self.w_packed, self.w_scale, self.w_global_scale, x_pairs=x_pairs, m1=self._m1(),
                          partials=partials, **self._m1_tile())

    @classmethod
    def concat(cls, parts: list["QuantLinear"]) -> "QuantLinear | None":
        """One Linear whose output rows are the parts' rows, or None when they cannot share a
        kernel: different formats, or NVFP4 parts with different global scales (export gives
        fused units one; concatenating others would change their values)."""
        kind = parts[0].kind
        if any(p.kind != kind for p in parts):
            return None
        cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
        if kind == "bf16":
            fused = cls("bf16", cat("weight"), dtype=parts[0].weight.dtype)
        elif kind == "fp8":
            fused = cls("fp8", cat("w_q"), cat("w_scale"), dtype=parts[0].weight.dtype)
        else:
            gs = parts[0].w_global_scale
            if any(not torch.equal(p.w_global_scale, gs) for p in parts) or any(
                    (p.input_global_scale is None) != (parts[0].input_global_scale is None) or (
                        p.input_global_scale is not None and not torch.equal(p.input_global_scale,
                                                                             parts[0].input_global_scale))
                    for p in parts):
                return None
            fused = cls(kind, cat("w_packed"), cat("w_scale"), gs, parts[0].input_global_scale,
                        dtype=parts[0].weight.dtype)
        fused.triton = parts[0].triton
        return fused


class FusedLinear(nn.Module):
    """Several Linears of the same input run as one weight stream (q/k/v, gate/up, the GDN
    input projections): one GEMV launch instead of several, the output split back as views."""

    def __init__(self, linear: QuantLinear, sizes: list[int]):
        super().__init__()
        self.linear, self.sizes = linear, sizes

    def forward(self, x: torch.Tensor, x_q: tuple | None = None) -> tuple[torch.Tensor, ...]:
        return self.linear(x, x_q).split(self.sizes, dim=-1)

    @classmethod
    def of(cls, parts: list[QuantLinear]) -> "FusedLinear | None":
        fused = QuantLinear.concat(parts)
        return None if fused is None else cls(fused, [p.out_features for p in parts])


class RMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: x / rms(x) * (1 + w), in fp32, cast back."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNormGated: norm in fp32, weight in the input dtype, then silu(gate) in fp32."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)


class MLP(nn.Module):
    def __init__(self, gate: QuantLinear, up: QuantLinear, down: QuantLinear):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down
        self.gate_up = None  # FusedLinear, set by fuse() for the triton backend

    def fuse(self) -> None:
        self.gate_up = FusedLinear.of([self.gate_proj, self.up_proj])
        if self.gate_up is not None:  # the parts' weights now live in the fused one only
            del self.gate_proj, self.up_proj

    def fused_silu(self) -> bool:
        """Whether batch 1 runs gate_up, silu·mul and the NVFP4 activation pairs in one launch
        (gemv_nvfp4_silu): W4A16 gate_up fused and a W4A16 down_proj."""
        return self.gate_up is not None and self.gate_up.linear.kind == "nvfp4" and self.down_proj.kind == "nvfp4"

    def fused_silu_bf16(self) -> bool:
        """Whether batch 1 runs a BF16 gate_up with silu·mul in its epilogue (gemv_bf16 silu):
        BF16 gate_up and down_proj, whose GEMV reads the bf16 product as it is."""
        return self.gate_up is not None and self.gate_up.linear.kind == "bf16" and self.down_proj.kind == "bf16"

    def input_linears(self) -> list:
        return [self.gate_up.linear] if self.gate_up is not None else [self.gate_proj, self.up_proj]

    def forward(self, x: torch.Tensor, x_q: tuple | None = None, partials: bool = False):
        """partials: down_proj's output may come back unreduced (QuantLinear.forward)."""
        down = self.down_proj
        fused = self.gate_up is not None and (self.gate_up.linear.m1_interleaved or self.fused_silu_bf16())
        if fused and x.numel() == x.shape[-1] and down.uses_kernels(x):  # batch 1: silu·mul in gate_up's epilogue
            gate_up = self.gate_up.linear
            if gate_up.m1_interleaved:  # NVFP4: down_proj's activation pairs straight from the epilogue
                if x_q is None or x_q[0].dtype != torch.int32:
                    from .kernels.gemv_nvfp4 import nvfp4_x_pairs

                    x_q = nvfp4_x_pairs(x.reshape(1, -1).contiguous())
                y = down.forward_pairs(gate_up.forward_silu_pairs(x_q), partials)
            else:
                y = down.forward_kernels(gate_up.forward_silu_bf16(x.reshape(1, -1)), None, partials)
            return y if isinstance(y, Partials) else y.reshape(*x.shape[:-1], -1)
        gate, up = self.gate_up(x, x_q) if self.gate_up is not None else (self.gate_proj(x, x_q), self.up_proj(x, x_q))
        if down.uses_kernels(x):
            from .kernels import silu_mul_quant

            m1 = x.shape[0] == 1
            if down.kind == "fp8":  # silu·mul and the per-token FP8 quantization down_proj needs, in one pass
                return down.forward_kernels(x, silu_mul_quant(gate, up, "fp8", half=m1), partials)
            if down.kind == "nvfp4" and m1:  # and the activation pairs its batch-1 GEMV reads
                h, pairs = silu_mul_quant(gate, up, "bf16", pairs=True)
                return down.forward_kernels(h, pairs, partials)
            return down.forward_kernels(silu_mul_quant(gate, up, "bf16"), None, partials)
        return down(F.silu(gate) * up)


def depthwise_causal_conv_silu(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[.., C, kernel] windows · [C, kernel] weights -> silu(conv) in the input dtype.

    The same sum F.conv1d computes, written out: on the CPU a depthwise F.conv1d in BF16 falls
    to a per-channel slow path (≈ 1 s per decode step of the bundled model, 96 % of it)."""
    y = (window.float() * weight.float()).sum(-1).to(window.dtype)
    return F.silu(y)


def _chunk_rule(gpu_kernels: bool):
    """The chunked gated delta rule for prefill: fla-core's Triton kernel when the triton
    backend runs on a GPU and fla-core is installed (DESIGN.md allows it for prefill), else
    transformers' torch function — the same math, what the torch backend must match."""
    if gpu_kernels:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            return chunk_gated_delta_rule
        except ImportError:
            pass
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule


class GatedDeltaNet(nn.Module):
    """A GDN token mixer whose conv and recurrent states are rows of per-slot buffers."""

    def __init__(self, cfg, p: dict, linears: dict[str, QuantLinear]):
        super().__init__()
        self.H, self.HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.K, self.V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.eps = cfg.rms_norm_eps
        self.in_proj_qkv, self.in_proj_z = linears["in_proj_qkv"], linears["in_proj_z"]
        self.in_proj_a, self.in_proj_b = linears["in_proj_a"], linears["in_proj_b"]
        self.out_proj = linears["out_proj"]
        self.register_buffer("conv_weight", p["conv1d.weight"].squeeze(1))  # [C, kernel]
        self.register_buffer("A_log", p["A_log"])
        self.register_buffer("dt_bias", p["dt_bias"])
        self.register_buffer("norm_weight", p["norm.weight"])
        self.conv_dim = 2 * self.H * self.K + self.HV * self.V
        self.kernel = self.conv_weight.shape[-1]
        self.fused: list[tuple[FusedLinear, list[str]]] = []  # set by fuse() for the triton backend

    _INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")

    def fuse(self) -> None:
        """All four input projections as one weight stream if they share a format, else
        qkv+z and a+b."""
        names = list(self._INPUTS)
        def of(group):
            return FusedLinear.of([getattr(self, n) for n in group]), group

        whole = of(names)
        for f, group in [whole] if whole[0] is not None else [of(names[:2]), of(names[2:])]:
            if f is not None:
                self.add_module("fused_" + "_".join(n[len("in_proj_"):] for n in group), f)
                self.fused.append((f, group))
                for n in group:
                    delattr(self, n)

    def input_linears(self) -> list:
        return [f.linear for f, _ in self.fused] + [getattr(self, n) for n in self._INPUTS if hasattr(self, n)]

    def _proj(self, x: torch.Tensor, x_q: tuple | None = None) -> dict[str, torch.Tensor]:
        out = {}
        for f, group in self.fused:
            out.update(zip(group, f(x, x_q)))
        for n in self._INPUTS:
            if n not in out:
                out[n] = getattr(self, n)(x, x_q)
        return out

    def alloc_state(self, slots: int, device, dtype) -> dict:
        return {"conv": torch.zeros(slots, self.conv_dim, self.kernel - 1, dtype=dtype, device=device),
                "ssm": torch.zeros(slots, self.HV, self.V, self.K, dtype=torch.float32, device=device)}

    def _qkv_gates(self, p, mixed):
        t = mixed.shape[:-1]
        q, k, v = torch.split(mixed, [self.H * self.K, self.H * self.K, self.HV * self.V], dim=-1)
        q, k = q.reshape(*t, self.H, self.K), k.reshape(*t, self.H, self.K)
        v = v.reshape(*t, self.HV, self.V)
        beta = p["in_proj_b"].sigmoid()
        g = -self.A_log.float().exp() * F.softplus(p["in_proj_a"].float() + self.dt_bias)
        if self.HV // self.H > 1:
            q = q.repeat_interleave(self.HV // self.H, dim=-2)
            k = k.repeat_interleave(self.HV // self.H, dim=-2)
        return q, k, v, g, beta

    def _out(self, core: torch.Tensor, x: torch.Tensor, p: dict) -> torch.Tensor:
        z = p["in_proj_z"].reshape(-1, self.V)
        o = gated_rmsnorm(core.reshape(-1, self.V), z, self.norm_weight, self.eps)
        return self.out_proj(o.reshape(*x.shape[:-1], -1))

    def prefill(self, x: torch.Tensor, state: dict, slot: int) -> torch.Tensor:
        """x [T, D] of one request -> [T, D]; writes the slot's conv and recurrent state."""
        p = self._proj(x)
        mixed = p["in_proj_qkv"].T  # [C, T]
        padded = F.pad(mixed, (self.kernel - 1, 0))                                  # zero history
        state["conv"][slot].copy_(padded[:, -(self.kernel - 1):])
        mixed = depthwise_causal_conv_silu(padded.unfold(1, self.kernel, 1), self.conv_weight[:, None]).T  # [T, C]
        q, k, v, g, beta = self._qkv_gates(p, mixed)
        core, final = _chunk_rule(self.triton and x.is_cuda)(
            q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=None, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        state["ssm"][slot].copy_(final[0].transpose(-1, -2))  # [HV, K, V] -> our [HV, V, K]
        return self._out(core[0].to(x.dtype), x, p)

    triton = False  # set by RuntimeModel(backend="triton")

    def decode(self, x: torch.Tensor, state: dict, step: Step, x_q: tuple | None = None, partials: bool = False):
        """x [B, D], one token per slot -> [B, D]; the slots' states advance in place. partials:
        out_proj's output may come back unreduced (QuantLinear.forward; triton only)."""
        p = self._proj(x, x_q)
        if self.triton:
            from .kernels import gdn_decode

            # Above batch 1 an FP8 out_proj's input is quantized by gdn_decode itself: one launch of
            # B programs fewer (batch 64: 7.43 -> 6.58 ms a step on an H200). At batch 1 the row's
            # quantization in one program at the end of gdn_decode cost more than the separate
            # PDL-launched kernel (2.29 -> 2.38 ms, BENCHMARKS.md, session 7).
            # At batch 1 it hands out_proj its output's absmax in parts instead, and out_proj's GEMV
            # quantizes (gemv_fp8_quantizing): the quantization kernel between the two is gone.
            quant = self.out_proj.producer_quant(x)
            o = gdn_decode(p["in_proj_qkv"], p["in_proj_z"], p["in_proj_a"], p["in_proj_b"], state["conv"],
                           self.conv_weight, self.A_log, self.dt_bias, self.norm_weight, state["ssm"], step.slots32,
                           self.H, self.K, self.V, self.eps, quant=quant)
            o, o_q = (o, None) if quant is None else o
            return self.out_proj(o, o_q, partials)
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

        slots = step.slots
        window = torch.cat([state["conv"][slots], p["in_proj_qkv"][:, :, None]], dim=-1)  # [B, C, kernel]
        state["conv"].index_copy_(0, slots, window[:, :, 1:].contiguous())
        mixed = depthwise_causal_conv_silu(window, self.conv_weight)
        q, k, v, g, beta = self._qkv_gates(p, mixed)
        s = state["ssm"][slots].transpose(-1, -2)  # [B, HV, K, V] as transformers keeps it
        core, new = torch_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g=g[:, None],
                                                     beta=beta[:, None], initial_state=s, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
        state["ssm"].index_copy_(0, slots, new.transpose(-1, -2).contiguous())
        return self._out(core[:, 0], x, p)


class Attention(nn.Module):
    """Qwen3.5's gated full attention (q_proj also yields a sigmoid gate), M-RoPE on a partial
    head dim, GQA; keys and values in a static per-slot cache."""

    def __init__(self, cfg, p: dict, linears: dict[str, QuantLinear]):
        super().__init__()
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (linears[n] for n in ("q_proj", "k_proj", "v_proj",
                                                                                    "o_proj"))
        self.q_norm = RMSNorm(p["q_norm.weight"], cfg.rms_norm_eps)
        self.k_norm = RMSNorm(p["k_norm.weight"], cfg.rms_norm_eps)
        self.qkv_proj = None  # FusedLinear, set by fuse() for the triton backend

    def input_linears(self) -> list:
        return [self.qkv_proj.linear] if self.qkv_proj is not None else [self.q_proj, self.k_proj, self.v_proj]

    def fuse(self) -> None:
        self.qkv_proj = FusedLinear.of([self.q_proj, self.k_proj, self.v_proj])
        if self.qkv_proj is not None:
            del self.q_proj, self.k_proj, self.v_proj

    def alloc_state(self, slots: int, max_len: int, device, dtype) -> dict:
        shape = (slots, self.kv_heads, max_len, self.head_dim)
        return {"k": torch.zeros(shape, dtype=dtype, device=device), "v": torch.zeros(shape, dtype=dtype, device=device)}

    def _qkv(self, x, cos, sin):
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

        t = x.shape[:-1]
        qg, k, v = self.qkv_proj(x) if self.qkv_proj is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, gate = torch.chunk(qg.reshape(*t, -1, self.head_dim * 2), 2, dim=-1)
        q = self.q_norm(q).transpose(-2, -3)                                   # [.., heads, T, hd]
        k = self.k_norm(k.reshape(*t, -1, self.head_dim)).transpose(-2, -3)
        v = v.reshape(*t, -1, self.head_dim).transpose(-2, -3)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=-3)
        return q, k, v, gate.reshape(*t, -1)

    def prefill(self, x, state, slot: int, cos, sin):
        """x [T, D]; cos/sin [T, rot]."""
        q, k, v, gate = self._qkv(x, cos, sin)
        n = x.shape[0]
        state["k"][slot, :, :n] = k
        state["v"][slot, :, :n] = v
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
        return self.o_proj(o.transpose(0, 1).reshape(n, -1) * torch.sigmoid(gate))

    triton = False  # set by RuntimeModel(backend="triton")

    def decode(self, x, state, step: Step, x_q: tuple | None = None, partials: bool = False):
        """x [B, D]: one token per slot at position lengths[b] of its cache (partials: as
        GatedDeltaNet.decode, for o_proj). The torch path
        gathers only the prefix any row can see (step.span); the triton path reads the cache in
        place (attn_decode), with no host sync, so the step can be a CUDA graph."""
        if self.triton:  # two kernels from q/k/v to the gated output (qk_norm_rope, attn_decode)
            from .kernels import attn_decode, qk_norm_rope

            b, hd = x.shape[0], self.head_dim
            qg, k, v = self.qkv_proj(x, x_q) if self.qkv_proj is not None else (
                self.q_proj(x, x_q), self.k_proj(x, x_q), self.v_proj(x, x_q))
            qg = qg.reshape(b, -1, 2 * hd)  # per head: q, then its output gate
            q = qk_norm_rope(qg[:, :, :hd], k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, step.cos,
                             step.sin, state["k"], state["v"], step.slots32, step.lengths32)
            # An FP8 o_proj's input: above batch 1 quantized in the merge launch, at batch 1 quantized
            # inside o_proj's GEMV from the absmax parts the merge writes (as gdn_decode does)
            quant = self.o_proj.producer_quant(x)
            o = attn_decode(q, state["k"], state["v"], step.slots32, step.lengths32, hd ** -0.5, gate=qg[:, :, hd:],
                            quant=quant)
            o, o_q = (o, None) if quant is None else o
            return self.o_proj(o.reshape(b, -1), o_q, partials)
        q, k, v, gate = self._qkv(x[:, None], step.cos[:, None], step.sin[:, None])  # q [B, heads, 1, hd]
        slots, lengths, span = step.slots, step.lengths, step.span
        state["k"][slots, :, lengths] = k[:, :, 0]
        state["v"][slots, :, lengths] = v[:, :, 0]
        keys, vals = state["k"][slots, :, :span], state["v"][slots, :, :span]  # [B, kv, span, hd]
        visible = torch.arange(span, device=x.device)[None, :] <= lengths[:, None]
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=visible[:, None, None, :], enable_gqa=True)
        return self.o_proj(o[:, :, 0].reshape(x.shape[0], -1) * torch.sigmoid(gate[:, 0]))
