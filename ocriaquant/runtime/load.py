"""Read a checkpoint directory (compressed-tensors from `ocriaquant export`, or a plain BF16
Qwen3.5 model) into our runtime's layers, without transformers' model classes for the text
decoder and without llmcompressor."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import OcriaError
from ..model.load import read_config, resolve_model_dir
from .layers.linear import QuantLinear

TEXT = "model.language_model."


class TensorStore:
    """All tensors of a checkpoint's safetensors files, opened lazily."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise OcriaError(f"{model_dir}: no *.safetensors files; is this a model directory?")
        self.where: dict[str, object] = {}
        self._handles = []
        for f in files:
            h = safe_open(str(f), "pt")
            self._handles.append(h)
            for k in h.keys():
                self.where[k] = h
        self.model_dir = model_dir

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str) -> torch.Tensor:
        if key not in self.where:
            raise KeyError(key)
        return self.where[key].get_tensor(key)

    def require(self, keys: list[str]) -> dict[str, torch.Tensor]:
        missing = [k for k in keys if k not in self.where]
        if missing:
            raise OcriaError(f"{self.model_dir}: missing tensors {', '.join(missing[:6])}"
                             f"{' …' if len(missing) > 6 else ''} ({len(missing)} in all); the checkpoint is "
                             "incomplete or not a Qwen3.5 model")
        return {k: self.get(k) for k in keys}


class MemoryStore(TensorStore):
    """The same interface over tensors already in memory (bench's random-weight shapes)."""

    def __init__(self, tensors: dict[str, torch.Tensor], label: str):
        self.tensors, self.where, self.model_dir = tensors, dict.fromkeys(tensors, None), Path(label)

    def get(self, key: str) -> torch.Tensor:
        return self.tensors[key]


def quant_schemes(cfg: dict) -> dict[str, str]:
    """Module name -> kind (fp8 / nvfp4 / nvfp4_w4a4) from a compressed-tensors config; an
    unsupported scheme is an error naming the group."""
    qc = cfg.get("quantization_config")
    if not qc:
        return {}
    if qc.get("quant_method") != "compressed-tensors":
        raise OcriaError(f"quantization method {qc.get('quant_method')!r} is not supported; ocriaquant serves "
                         "compressed-tensors checkpoints (FP8_DYNAMIC, NVFP4, NVFP4A16) and BF16 models")
    kinds = {}
    for name, grp in qc.get("config_groups", {}).items():
        w, a = grp.get("weights") or {}, grp.get("input_activations")
        if w.get("type") == "float" and w.get("num_bits") == 8 and w.get("strategy") == "channel" and a \
                and a.get("num_bits") == 8 and a.get("dynamic") and a.get("strategy") == "token":
            kind = "fp8"
        elif w.get("type") == "float" and w.get("num_bits") == 4 and w.get("group_size") == 16:
            kind = "nvfp4" if a is None else "nvfp4_w4a4"
        else:
            raise OcriaError(f"quantization config group {name!r} ({w.get('type')} {w.get('num_bits')}-bit weights, "
                             f"strategy {w.get('strategy')}) is not a format ocriaquant serves: FP8 W8A8 per channel "
                             "/ per token, NVFP4 W4A16 or W4A4")
        for t in grp.get("targets", []):
            if t.startswith("re:"):
                raise OcriaError(f"config group {name!r} targets a pattern ({t}); ocriaquant needs exact module "
                                 "names as `ocriaquant export` writes them")
            kinds[t] = kind
    return kinds


def read_linear(store: TensorStore, name: str, kind: str | None, dtype: torch.dtype = torch.bfloat16,
                kernels=None):
    """The Linear `name` in its format (kind: quant_schemes' value, None for BF16); kernels:
    config.Kernels for the triton backend."""
    if kind is None:
        return QuantLinear("bf16", store.require([name + ".weight"])[name + ".weight"], dtype=dtype, kernels=kernels)
    if kind == "fp8":
        t = store.require([name + ".weight", name + ".weight_scale"])
        return QuantLinear("fp8", t[name + ".weight"], t[name + ".weight_scale"], dtype=dtype, kernels=kernels)
    keys = [name + ".weight_packed", name + ".weight_scale", name + ".weight_global_scale"]
    if kind == "nvfp4_w4a4":
        keys.append(name + ".input_global_scale")
    t = store.require(keys)
    return QuantLinear(kind, t[keys[0]], t[keys[1]], t[keys[2]], t.get(name + ".input_global_scale"), dtype=dtype,
                       kernels=kernels)


def open_checkpoint(path) -> tuple[Path, dict, TensorStore, dict[str, str]]:
    model_dir = resolve_model_dir(path)
    cfg = read_config(model_dir)
    return model_dir, cfg, TensorStore(model_dir), quant_schemes(cfg)


__all__ = ["MemoryStore", "TensorStore", "open_checkpoint", "quant_schemes", "read_linear", "TEXT"]
