"""Triton kernels for decode, one file each, each with its plain-torch reference beside it
(`*_ref`). On the CPU they run under TRITON_INTERPRET=1 (what CI checks, at small shapes)."""

from .add_rmsnorm import add_rmsnorm, add_rmsnorm_ref
from .attn_decode import attn_decode, attn_decode_ref
from .gdn_decode import gdn_decode, gdn_decode_ref
from .gemv_bf16 import gemv_bf16, gemv_bf16_ref
from .gemv_fp8 import gemv_fp8, gemv_fp8_quantizing, gemv_fp8_ref, quant_fp8_per_token
from .gemv_nvfp4 import gemv_nvfp4, gemv_nvfp4_ref
from .greedy_advance import greedy_advance, greedy_advance_ref
from .qk_norm_rope import qk_norm_rope, qk_norm_rope_ref
from .silu_mul_quant import silu_mul_quant, silu_mul_quant_ref
from .step_inputs import step_inputs, step_inputs_ref

__all__ = ["add_rmsnorm", "add_rmsnorm_ref", "attn_decode", "attn_decode_ref", "gdn_decode", "gdn_decode_ref",
           "gemv_bf16", "gemv_bf16_ref", "gemv_fp8", "gemv_fp8_quantizing", "gemv_fp8_ref", "gemv_nvfp4",
           "gemv_nvfp4_ref", "greedy_advance", "greedy_advance_ref", "qk_norm_rope", "qk_norm_rope_ref",
           "quant_fp8_per_token", "silu_mul_quant", "silu_mul_quant_ref", "step_inputs",
           "step_inputs_ref"]
