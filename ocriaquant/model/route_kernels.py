"""Keep transformers' Qwen3.5 on its torch functions for CPU tensors when fla-core is installed.

transformers 5.17 binds the module-level gated-delta-rule functions of Qwen3.5
(`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`) to fla-core's Triton kernels
whenever fla-core is importable (`use_kernel_func_from_hub_with_fallback`), and the conv functions
to causal-conv1d's CUDA kernels when that is. The binding ignores the device: on CPU tensors the
Triton kernels fail ("Pointer argument ... cannot be accessed from Triton (cpu tensor?)"), so a
machine with fla-core could not calibrate, export or verify on its CPU, and the runtime's torch
backend could not run there. `route_by_device` swaps each bound function for one that sends
CUDA inputs to the bound kernel and other inputs to transformers' own torch function (the
decorator's `__wrapped__`), which is what transformers runs without fla-core.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import Callable

_NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
          "causal_conv1d_update")
_PACKAGES = ("fla", "causal_conv1d")


def routed(bound: Callable, reference: Callable) -> Callable:
    """A function that calls `bound` when its first argument is a CUDA tensor and `reference`
    otherwise, with the keyword arguments `reference` accepts (transformers' wrapper filters them
    the same way: the model passes ones, such as cu_seqlens, that not every implementation takes)."""
    params = inspect.signature(reference).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(reference)
    def call(x, *args, **kwargs):
        if getattr(x, "is_cuda", False):
            return bound(x, *args, **kwargs)
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return reference(x, *args, **kwargs)

    call.bound = bound  # marks it routed (route_by_device is idempotent) and keeps the kernel for tests
    return call


def route_by_device(force: bool = False) -> list[str]:
    """Route transformers' Qwen3.5 kernel-bound functions by device (see the module docstring).
    Does nothing unless fla-core or causal-conv1d is importable (force: route anyway, for tests);
    idempotent. Returns the names routed by this call."""
    if not force and not any(importlib.util.find_spec(p) for p in _PACKAGES):
        return []
    from transformers.models.qwen3_5 import modeling_qwen3_5 as module

    done = []
    for name in _NAMES:
        bound = getattr(module, name, None)
        if bound is None or hasattr(bound, "bound"):  # absent, or routed already
            continue
        reference = inspect.unwrap(bound)
        if reference is bound:  # not a kernel-bound wrapper in this transformers version
            continue
        setattr(module, name, routed(bound, reference))
        done.append(name)
    return done
