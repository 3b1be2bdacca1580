"""Linears in our formats (BF16, FP8 W8A8, NVFP4 W4A16 / W4A4) and several of one input run as
one weight stream."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...quant import fp8, nvfp4
from ..config import Kernels
from ..kernels.partials import Partials

KINDS = ("bf16", "fp8", "nvfp4", "nvfp4_w4a4")
MAX_KERNEL_ROWS = 64  # the GEMV kernels take decode-sized batches; above, torch


class QuantLinear(nn.Module):
    """A Linear in one of our formats. The torch path computes with the dequantized weight
    (exactly compressed-tensors' decompression) and, for W8A8 / W4A4, fake-quantized inputs,
    which is what transformers does with the same checkpoint. With `kernels` (the triton
    backend) decode-sized BF16 inputs go through the weight-streaming GEMVs, which read the packed
    tensors, at the tiles of its kernels.tiles (runtime/tiles.py), and FP8 prefill rows run W8A8
    on the tensor cores (forward_w8a8)."""

    def __init__(self, kind: str, weight: torch.Tensor, scale: torch.Tensor | None = None,
                 global_scale: torch.Tensor | None = None, input_global_scale: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16, kernels: Kernels | None = None):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown QuantLinear kind {kind!r}; one of {KINDS}")
        self.kind, self.kernels = kind, kernels
        # the tile table's kind: W4A4 runs the W4A16 GEMV on activations rounded first
        self.tile_kind = "nvfp4" if kind == "nvfp4_w4a4" else kind
        # A buffer, so it moves with the module and the forward needs no per-call .to(device).
        self.register_buffer("input_global_scale", input_global_scale)
        if kind == "bf16":
            w = weight.to(dtype)
        elif kind == "fp8":
            self.register_buffer("w_q", weight)
            self.register_buffer("w_scale", scale)
            self.register_buffer("w_scale_row", scale.float().reshape(1, -1))  # what _scaled_mm takes
            w = fp8.dequantize(weight, scale).to(dtype)
        else:
            self.register_buffer("w_packed", weight)
            self.register_buffer("w_scale", scale)
            self.register_buffer("w_global_scale", global_scale.reshape(1).float())
            # the scale may sit apart from a meta-device weight (tests that build a model's shapes only)
            w = nvfp4.dequantize(weight, scale, self.w_global_scale.to(weight.device), dtype)
        self.register_buffer("weight", w)
        self.out_features, self.in_features = w.shape
        self.register_buffer("w_m1", None)  # NVFP4: the batch-1 kernel's weight words (pack_m1)
        self.register_buffer("w_m1_scale", None)
        self.m1_interleaved = False

    def pack_m1(self, interleave: bool = False) -> None:
        """NVFP4: write the weight once more in the batch-1 kernel's bit order (gemv_nvfp4.pack_m1),
        on the weight's device; interleave: a fused gate_up whose batch-1 output is silu(gate) · up
        (MLP.forward). Done by the model for the triton backend, before any CUDA graph."""
        from ..kernels.gemv_nvfp4 import pack_m1

        self.w_m1, self.w_m1_scale = pack_m1(self.w_packed, self.w_scale, interleave)
        self.m1_interleaved = interleave

    def uses_kernels(self, x: torch.Tensor) -> bool:
        """The GEMV kernels take decode-sized BF16 rows; all else is torch."""
        return self.kernels is not None and x.ndim >= 2 and x.numel() // x.shape[-1] <= MAX_KERNEL_ROWS \
            and x.dtype == torch.bfloat16

    def tile(self, m: int = 1, kind: str | None = None) -> dict:
        """The GEMV's tile at batch m for this weight's shape (kind: this Linear's, or fp8_qx /
        nvfp4_silu for those kernels)."""
        return self.kernels.tiles.tile(kind or self.tile_kind, self.out_features, self.in_features, m)

    def tile_keys(self, m1_kind: str | None = None, quantizes_input: bool = False) -> list[tuple[str, int, int, int]]:
        """(kind, n, k, batch) of every tile this Linear's GEMVs can look up on the kernel path.
        m1_kind: the batch-1 kernel's kind when not this Linear's (nvfp4_silu); quantizes_input:
        its producer hands it an FP8 input's absmax at batch 1 (fp8_qx)."""
        n, k = self.out_features, self.in_features
        keys = [(m1_kind or self.tile_kind, n, k, 1)]
        if self.kind == "fp8":
            keys += [("fp8", n, k, m) for m in range(2, MAX_KERNEL_ROWS + 1)]
            keys += [("fp8_qx", n, k, 1)] if quantizes_input else []
        return keys

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
        scales) (kernels/half2.py). The kernel path uses it instead of converting x again; the
        torch path ignores it. partials: the caller hands the output to add_rmsnorm, so a batch-1
        GEMV that splits K may return its splits unreduced (kernels/partials.py)."""
        if self.uses_kernels(x):
            y = self.forward_kernels(x.reshape(-1, x.shape[-1]), x_q, partials)
            return y if isinstance(y, Partials) else y.reshape(*x.shape[:-1], -1)
        if self.kind == "fp8" and self.kernels is not None and x.dtype == torch.bfloat16:
            return self.forward_w8a8(x, x_q if x_q is not None and x_q[0].dtype == torch.float8_e4m3fn else None)
        if self.kind == "fp8":
            x = fp8.fake_quant_activation(x)
        elif self.kind == "nvfp4_w4a4":
            x = nvfp4.fake_quant_activation(x, self.input_global_scale)
        return F.linear(x, self.weight)

    def forward_kernels(self, x: torch.Tensor, x_q: tuple | None = None, partials: bool = False):
        """Decode rows: FP8 through gemv_fp8 at every M; BF16 and NVFP4 through their
        weight-streaming GEMVs at M = 1; above, NVFP4 through gemv_nvfp4's tensor-core form where
        the tile table has a tile for that batch (measured faster than cuBLAS there: a verify step's
        k+1 rows read the packed weight), else cuBLAS. `x_q`, `partials`: see forward."""
        m, pdl = x.shape[0], self.kernels.pdl
        # x_q's first item tells its form: E4M3 codes for FP8, int32 words for NVFP4 pairs, fp32 for
        # x's absmax in parts (batch 1, FP8: quantized inside the GEMV)
        form = None if x_q is None else x_q[0].dtype
        if self.kind == "fp8":
            from ..kernels.gemv_fp8 import gemv_fp8, gemv_fp8_quantizing, quant_fp8_per_token

            if form == torch.float32 and m == 1:
                return gemv_fp8_quantizing(x, x_q[0], self.w_q, self.w_scale, partials=partials, pdl=pdl,
                                           **self.tile(1, "fp8_qx"))
            q, s, *half = x_q if form == torch.float8_e4m3fn else quant_fp8_per_token(x.contiguous(), half=m == 1,
                                                                                       pdl=pdl)
            return gemv_fp8(q, s, self.w_q, self.w_scale, x_half=half[0] if half else None, partials=partials,
                            pdl=pdl, **self.tile(m))
        if self.kind == "nvfp4_w4a4":  # no W4A4 kernel on Hopper: emulate the activation rounding
            x = nvfp4.fake_quant_activation(x, self.input_global_scale)
        if m > 1:
            dot = self.tile_kind == "nvfp4" and self.kernels.tiles.find("nvfp4", self.out_features, self.in_features, m)
            if dot:
                from ..kernels.gemv_nvfp4 import gemv_nvfp4

                return gemv_nvfp4(x.contiguous(), self.w_packed, self.w_scale, self.w_global_scale, path="dot",
                                  pdl=pdl, **dot)
            # BF16, and W4A16 where the table has no tile: cuBLAS on the dequantized weight, the same values
            return F.linear(x, self.weight)
        if self.kind == "bf16":
            from ..kernels.gemv_bf16 import gemv_bf16

            return gemv_bf16(x.contiguous(), self.weight, pdl=pdl, **self.tile())
        from ..kernels.gemv_nvfp4 import gemv_nvfp4

        return gemv_nvfp4(x.contiguous(), self.w_packed, self.w_scale, self.w_global_scale,
                          x_pairs=x_q if form == torch.int32 else None, m1=self._m1(), partials=partials, pdl=pdl,
                          **self.tile())

    def forward_w8a8(self, x: torch.Tensor | None, x_q: tuple | None = None) -> torch.Tensor:
        """Prefill rows, FP8: per-token E4M3 activations (quant_fp8_per_token: the numerics of
        fp8.fake_quant_activation) times the E4M3 weight on the tensor cores, both scales applied
        to the fp32 sums (torch._scaled_mm, rowwise) — the W8A8 product the checkpoint defines,
        at twice the BF16 rate on Hopper (BENCHMARKS.md). x_q: x's codes and scales made by the
        kernel that wrote x (add_rmsnorm, silu_mul_quant: the same numerics); x may then be None."""
        from ..kernels.gemv_fp8 import quant_fp8_per_token

        if x_q is None:
            lead = x.shape[:-1]
            q, s = quant_fp8_per_token(x.reshape(-1, self.in_features).contiguous(), pdl=self.kernels.pdl)
        else:
            lead = x_q[0].shape[:-1]
            q, s = x_q[0].reshape(-1, self.in_features), x_q[1].reshape(-1, 1)
        y = torch._scaled_mm(q, self.w_q.t(), scale_a=s, scale_b=self.w_scale_row, out_dtype=self.weight.dtype)
        return y.reshape(*lead, -1)

    def _m1(self) -> tuple | None:
        if self.m1_interleaved:  # its rows are reordered for gemv_nvfp4_silu, which MLP calls
            raise RuntimeError("this gate_up's batch-1 weight is interleaved for the fused SiLU; use MLP")
        return None if self.w_m1 is None else (self.w_m1, self.w_m1_scale)

    def forward_silu_pairs(self, x_pairs: tuple) -> tuple:
        """Batch 1, NVFP4 gate_up packed with interleave: silu(gate) · up as down_proj's activation
        pairs, from this GEMV's epilogue (gemv_nvfp4_silu)."""
        from ..kernels.gemv_nvfp4 import gemv_nvfp4_silu

        return gemv_nvfp4_silu(x_pairs, (self.w_m1, self.w_m1_scale), self.w_global_scale, pdl=self.kernels.pdl,
                               **self.tile(1, "nvfp4_silu"))

    def forward_silu_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """Batch 1, a BF16 fused gate_up: silu(gate) · up [1, I] from the GEMV's epilogue
        (gemv_bf16 silu), the launch of silu_mul_quant saved. The tile is the unfused GEMV's: a
        CTA streams that many gate rows and as many up rows."""
        from ..kernels.gemv_bf16 import gemv_bf16

        return gemv_bf16(x, self.weight, silu=True, pdl=self.kernels.pdl, **self.tile())

    def forward_pairs(self, x_pairs: tuple, partials: bool = False):
        """Batch 1, NVFP4 (W4A16): y [1, N] from activations that arrive as pairs only
        (`partials`: see forward)."""
        from ..kernels.gemv_nvfp4 import gemv_nvfp4

        return gemv_nvfp4(None, self.w_packed, self.w_scale, self.w_global_scale, x_pairs=x_pairs, m1=self._m1(),
                          partials=partials, pdl=self.kernels.pdl, **self.tile())

    @classmethod
    def concat(cls, parts: list["QuantLinear"]) -> "QuantLinear | None":
        """One Linear whose output rows are the parts' rows, or None when they cannot share a
        kernel: different formats, or NVFP4 parts with different global scales (export gives
        fused units one; concatenating others would change their values)."""
        kind, first = parts[0].kind, parts[0]
        if any(p.kind != kind for p in parts):
            return None
        cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
        if kind == "bf16":
            return cls("bf16", cat("weight"), dtype=first.weight.dtype, kernels=first.kernels)
        if kind == "fp8":
            return cls("fp8", cat("w_q"), cat("w_scale"), dtype=first.weight.dtype, kernels=first.kernels)
        gs, igs = first.w_global_scale, first.input_global_scale
        if any(not torch.equal(p.w_global_scale, gs) for p in parts) or any(
                (p.input_global_scale is None) != (igs is None) or (
                    igs is not None and not torch.equal(p.input_global_scale, igs)) for p in parts):
            return None
        return cls(kind, cat("w_packed"), cat("w_scale"), gs, igs, dtype=first.weight.dtype, kernels=first.kernels)


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
