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


def runtime_kind(fmt: str, target: str) -> str | None:
    """How a plan's format runs on a target, as the runtime's kind (None: BF16): FP8 is W8A8 on
    both targets; NVFP4 is weight-only (W4A16) on h200, W4A4 on b200 (activations rounded per
    16-block at run time under the static input global scale), as export's presets write them."""
    if target not in ("h200", "b200"):
        raise OcriaError(f"unknown target {target!r}; choose h200 or b200")
    kinds = {"bf16": None, "fp8": "fp8", "nvfp4": "nvfp4" if target == "h200" else "nvfp4_w4a4"}
    if fmt not in kinds:
        raise OcriaError(f"unknown format {fmt!r}; expected bf16, fp8 or nvfp4")
    return kinds[fmt]


def quantize_in_memory(tensors: dict[str, torch.Tensor], units: list[tuple[list[str], str]],
                       input_absmax: dict[str, torch.Tensor] | None = None,
                       cache: dict | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors a checkpoint exported with `units` holds, from a BF16 model's `tensors` (its
    safetensors keys), without writing one: (tensors, module name -> kind) for a MemoryStore.

    units: (member Linear names, kind) with kind fp8, nvfp4 or nvfp4_w4a4 (runtime_kind);
    members of a unit share one NVFP4 global scale, as export re-ties them. Weights are quantized
    in BF16 with quant/, as export quantizes the model it loads in BF16 (bit for bit what
    compressed-tensors writes); a W4A4 member's input global scale comes from its calibration
    input absmax (`input_absmax`), as export sets it. A tied lm_head is quantized from the input
    embeddings, which stay as they are. `cache` (a dict kept by the caller) holds each unit's
    quantized tensors for the next call: candidates that share a unit's format share its work."""
    from ..quant import fp8, nvfp4

    out, kinds = dict(tensors), {}
    for members, kind in units:
        if kind not in ("fp8", "nvfp4", "nvfp4_w4a4"):
            raise OcriaError(f"unknown quantized kind {kind!r} for {members[0]}; one of fp8, nvfp4, nvfp4_w4a4")
        fmt = "fp8" if kind == "fp8" else "nvfp4"
        key = (tuple(members), fmt)
        done = None if cache is None else cache.get(key)
        if done is None:
            ws = []
            for n in members:
                w = tensors.get(n + ".weight")
                if w is None and n == "lm_head":  # tied to the input embeddings
                    w = tensors.get(TEXT + "embed_tokens.weight")
                if w is None:
                    raise OcriaError(f"no weight {n}.weight to quantize; the plan names a Linear this model lacks")
                ws.append(w.to(torch.bfloat16))
            done = {}
            with torch.no_grad():
                gs = nvfp4.global_scale(*ws) if fmt == "nvfp4" else None
                for n, w in zip(members, ws):
                    if fmt == "fp8":
                        q, s = fp8.quantize_weight(w, n)
                        done.update({n + ".weight": q, n + ".weight_scale": s})
                    else:
                        packed, s, g = nvfp4.quantize_weight(w, gs, n)
                        done.update({n + ".weight_packed": packed, n + ".weight_scale": s,
                                     n + ".weight_global_scale": g})
            if cache is not None:
                cache[key] = done
        for n in members:
            out.pop(n + ".weight", None)
            kinds[n] = kind
            if kind == "nvfp4_w4a4":
                if not input_absmax or n not in input_absmax:
                    raise OcriaError(f"{n}: W4A4 needs its calibration input absmax (the static input global "
                                     "scale); the calibration has none for it")
                in_gs = nvfp4.global_scale_from_absmax(input_absmax[n].to(torch.bfloat16))
                out[n + ".input_global_scale"] = in_gs.to(done[n + ".weight_global_scale"].device)
        out.update(done)
    return out, kinds


def open_checkpoint(path) -> tuple[Path, dict, TensorStore, dict[str, str]]:
    model_dir = resolve_model_dir(path)
    cfg = read_config(model_dir)
    return model_dir, cfg, TensorStore(model_dir), quant_schemes(cfg)


__all__ = ["MemoryStore", "TensorStore", "open_checkpoint", "quant_schemes", "quantize_in_memory", "read_linear",
           "runtime_kind", "TEXT"]
