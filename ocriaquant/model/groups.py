"""Layer groups: the unit the search assigns a format to (DESIGN.md, Contracts).

One group per (decoder layer, block):
  gdn_in    in_proj_qkv + in_proj_z        one fused unit (vLLM fuses them at load)
  gdn_ab    in_proj_a + in_proj_b          always BF16 (tiny, and feed the gates)
  gdn_out   out_proj
  attn_qkv  q_proj + k_proj + v_proj       one fused unit
  attn_o    o_proj
  mlp_up    gate_proj + up_proj            one fused unit
  mlp_down  down_proj
plus `lm_head` and `vision` (always BF16). Members of a group share one format and, for
NVFP4, one global scale. Everything else (conv1d, norms, A_log, dt_bias, embeddings) keeps
its original dtype and belongs to no group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

FORMATS = ("bf16", "fp8", "nvfp4")
# Bits per weight as stored: FP8 adds one fp32 scale per output row, NVFP4 one E4M3 scale per
# 16 values (4 + 8/16 = 4.5 bits) and one fp32 global scale per tensor.
BITS_PER_WEIGHT = {"bf16": 16.0, "fp8": 8.0, "nvfp4": 4.5}

_LAYER_BLOCKS = {
    "linear_attn": (
        ("gdn_in", ("in_proj_qkv", "in_proj_z")),
        ("gdn_ab", ("in_proj_a", "in_proj_b")),
        ("gdn_out", ("out_proj",)),
    ),
    "self_attn": (
        ("attn_qkv", ("q_proj", "k_proj", "v_proj")),
        ("attn_o", ("o_proj",)),
    ),
    "mlp": (
        ("mlp_up", ("gate_proj", "up_proj")),
        ("mlp_down", ("down_proj",)),
    ),
}
ALWAYS_BF16_KINDS = frozenset({"gdn_ab", "vision"})
GROUP_KINDS = tuple(k for blocks in _LAYER_BLOCKS.values() for k, _ in blocks) + ("lm_head", "vision")


@dataclass
class LayerGroup:
    name: str                 # "layers.3.mlp_up", "lm_head", "vision"
    kind: str                 # one of GROUP_KINDS
    layer: int | None         # decoder layer index, None for lm_head / vision
    members: list[str]        # full module names of the nn.Linear members
    shapes: list[tuple[int, int]] = field(default_factory=list)  # (out, in) per member

    @property
    def always_bf16(self) -> bool:
        return self.kind in ALWAYS_BF16_KINDS

    @property
    def fused(self) -> bool:
        return len(self.members) > 1 and self.kind != "vision"

    @property
    def params(self) -> int:
        return sum(o * i for o, i in self.shapes)

    def bytes(self, fmt: str) -> float:
        """Weight bytes read per decode step in `fmt` (always-BF16 groups stay BF16)."""
        if fmt not in BITS_PER_WEIGHT:
            raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
        bits = BITS_PER_WEIGHT["bf16" if self.always_bf16 else fmt]
        return self.params * bits / 8


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    for name, mod in model.named_modules():
        if name.endswith("language_model.layers") and isinstance(mod, nn.ModuleList):
            return name, mod
    raise ValueError("no `language_model.layers` in the model: not a Qwen3.5 VLM")


def _shape(mod: nn.Module) -> tuple[int, int]:
    return (mod.out_features, mod.in_features)


def discover_groups(model: nn.Module) -> list[LayerGroup]:
    """Every layer group of a Qwen3.5 VLM, in execution order (vision first, lm_head last)."""
    prefix, layers = _decoder_layers(model)
    groups: list[LayerGroup] = []

    vision_name = next((n for n, _ in model.named_modules() if n.endswith("visual")), None)
    if vision_name is None:
        raise ValueError("no vision tower (`visual`) in the model: not a Qwen3.5 VLM")
    vision = model.get_submodule(vision_name)
    vis_members = [f"{vision_name}.{n}" for n, m in vision.named_modules() if isinstance(m, nn.Linear)]
    vis_shapes = [_shape(model.get_submodule(n)) for n in vis_members]
    groups.append(LayerGroup("vision", "vision", None, vis_members, vis_shapes))

    for i, layer in enumerate(layers):
        for block_attr, blocks in _LAYER_BLOCKS.items():
            block = getattr(layer, block_attr, None)
            if block is None:
                continue
            for kind, attrs in blocks:
                members = [f"{prefix}.{i}.{block_attr}.{a}" for a in attrs]
                mods = [getattr(block, a, None) for a in attrs]
                missing = [m for m, mod in zip(members, mods) if not isinstance(mod, nn.Linear)]
                if missing:
                    raise ValueError(f"layer {i}: expected nn.Linear at {missing}")
                groups.append(LayerGroup(f"layers.{i}.{kind}", kind, i, members, [_shape(m) for m in mods]))

    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise ValueError("no `lm_head` Linear in the model: not a Qwen3.5 VLM")
    groups.append(LayerGroup("lm_head", "lm_head", None, ["lm_head"], [_shape(head)]))
    return groups


def unassigned_linears(model: nn.Module, groups: list[LayerGroup]) -> list[str]:
    """Linear modules that belong to no group (should be none; used by tests and `info`)."""
    assigned = {m for g in groups for m in g.members}
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in assigned]


def layer_types(model: nn.Module) -> list[str]:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return list(cfg.layer_types)


def decode_bytes(groups: list[LayerGroup], plan: dict[str, str] | str) -> float:
    """Weight bytes of the decoder + head read per decode step under a plan (or one format for all).

    The vision tower runs once per page, not per step, so it is not counted.
    """
    total = 0.0
    for g in groups:
        if g.kind == "vision":
            continue
        fmt = plan if isinstance(plan, str) else plan.get(g.name, "bf16")
        total += g.bytes(fmt)
    return total


def decoder_linear_params(groups: list[LayerGroup]) -> int:
    return sum(g.params for g in groups if g.layer is not None)


def meta_model(config) -> nn.Module:
    """Build a model on the meta device: shapes without memory, for `info` on large configs."""
    from transformers import Qwen3_5ForConditionalGeneration

    with torch.device("meta"):
        return Qwen3_5ForConditionalGeneration(config)
