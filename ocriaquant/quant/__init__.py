"""Numerics: FP8 / NVFP4 quantize, dequantize, pack, fake-quant. The single source of truth.

Imports nothing else of ocriaquant.
"""

from . import fp8, nvfp4
from .common import FP8_MAX, FP4_MAX, NVFP4_GROUP, check_finite

__all__ = ["fp8", "nvfp4", "FP8_MAX", "FP4_MAX", "NVFP4_GROUP", "check_finite"]
