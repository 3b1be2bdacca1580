"""Simulate a quantization plan on a float model, in the numerics of a target GPU.

Kinds of simulation (what a Linear becomes):
  fp8    W8A8: FP8 weights per channel, FP8 activations per token (both targets)
  w4a16  NVFP4 weights, BF16 activations (h200: no FP4 tensor cores, Marlin-style)
  w4a4   NVFP4 weights and NVFP4 activations, static input global scale (b200)

Each quantized Linear gets a new weight Parameter holding its dequantized values (bit-exact
with the exported checkpoint); the original Parameter object is set aside, not modified, so
a tied lm_head never drags the input embeddings along. Activation quantization is a
forward pre-hook. `restore()` puts the original Parameters back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from . import fp8, nvfp4

KINDS = ("fp8", "w4a16", "w4a4")
TARGETS = ("h200", "b200")


def kind_for(fmt: str, target: str) -> str | None:
    """Simulation kind of a format on a target; None for bf16."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; choose one of {TARGETS}")
    if fmt == "bf16":
        return None
    if fmt == "fp8":
        return "fp8"
    if fmt == "nvfp4":
        return "w4a4" if target == "b200" else "w4a16"
    raise ValueError(f"unknown format {fmt!r}; expected bf16, fp8 or nvfp4")


def plan_units(plan: dict[str, str], members: dict[str, list[str]], target: str) -> list[tuple[list[str], str]]:
    """A plan (group -> format) as `simulate`'s units on `target`; `members` maps each group
    to its Linear names. BF16 groups are left out."""
    return [(members[g], kind_for(f, target)) for g, f in plan.items() if f != "bf16"]


def quantized_weight(weight: torch.Tensor, kind: str, gscale: torch.Tensor | None = None,
                     name: str = "weight") -> torch.Tensor:
    """The dequantized weight a `kind` Linear computes with."""
    if kind == "fp8":
        return fp8.fake_quant_weight(weight, name)
    return nvfp4.fake_quant_weight(weight, gscale, name)


def quantize_input(x: torch.Tensor, kind: str, input_gscale: torch.Tensor | None = None) -> torch.Tensor:
    if kind == "fp8":
        return fp8.fake_quant_activation(x)
    if kind == "w4a4":
        if input_gscale is None:
            input_gscale = nvfp4.global_scale_from_absmax(x.detach().abs().amax())
        return nvfp4.fake_quant_activation(x, input_gscale)
    return x


@dataclass
class Simulation:
    model: nn.Module
    saved: dict[str, nn.Parameter] = field(default_factory=dict)
    hooks: list = field(default_factory=list)

    def restore(self) -> None:
        for name, w in self.saved.items():
            self.model.get_submodule(name).weight = w
        for h in self.hooks:
            h.remove()
        self.saved.clear()
        self.hooks.clear()

    def __enter__(self) -> "Simulation":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


@torch.no_grad()
def simulate(model: nn.Module, units: list[tuple[list[str], str]],
             input_absmax: dict[str, torch.Tensor] | None = None) -> Simulation:
    """Apply `units`: (member Linear names, kind) pairs; members of a unit share one NVFP4
    global scale. `input_absmax` (per Linear, from calibration) sets the static W4A4 input
    global scale; without it the scale is taken from each batch."""
    sim = Simulation(model)
    try:
        for members, kind in units:
            if kind not in KINDS:
                raise ValueError(f"unknown simulation kind {kind!r}; expected one of {KINDS}")
            mods = [model.get_submodule(m) for m in members]
            gscale = nvfp4.global_scale(*(m.weight for m in mods)) if kind != "fp8" else None
            for name, mod in zip(members, mods):
                sim.saved[name] = mod.weight
                mod.weight = nn.Parameter(quantized_weight(mod.weight.detach(), kind, gscale, name),
                                          requires_grad=False)
                if kind in ("fp8", "w4a4"):
                    in_gs = None
                    if kind == "w4a4" and input_absmax is not None and name in input_absmax:
                        in_gs = nvfp4.global_scale_from_absmax(input_absmax[name].to(mod.weight.dtype))

                    def pre_hook(module, args, kind=kind, in_gs=in_gs):
                        return (quantize_input(args[0], kind, in_gs),) + tuple(args[1:])

                    sim.hooks.append(mod.register_forward_pre_hook(pre_hook))
    except Exception:
        sim.restore()
        raise
    return sim
