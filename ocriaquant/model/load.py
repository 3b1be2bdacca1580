"""Load a Qwen3.5 VLM and its processor from a local directory (never from a hub)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import OcriaError
from .processor import PageProcessor, load_processor

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_MODEL = ASSETS / "ocria-nano"
SUPPORTED = "Qwen3.5 VLMs (model_type 'qwen3_5', Qwen3_5ForConditionalGeneration), e.g. OCRia-1"
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
          "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}


def resolve_model_dir(model: str | Path | None) -> Path:
    path = Path(model) if model else DEFAULT_MODEL
    if not path.is_dir():
        hint = " (model ids are not downloaded: pass a local directory)" if model and "/" in str(model) else ""
        raise OcriaError(f"{path}: not a directory{hint}")
    return path


def read_config(model_dir: Path) -> dict:
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        raise OcriaError(f"{cfg_path}: missing; a model directory needs config.json ({SUPPORTED})")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise OcriaError(f"{cfg_path}: not valid JSON ({e})") from e
    model_type = cfg.get("model_type")
    if model_type != "qwen3_5":
        arch = ", ".join(cfg.get("architectures") or []) or "unknown architecture"
        raise OcriaError(f"{model_dir}: model_type {model_type!r} ({arch}) is not supported; "
                         f"ocriaquant supports {SUPPORTED}")
    return cfg


def to_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise OcriaError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_model(model: str | Path | None = None, dtype: str | torch.dtype = "bf16", device: str = "cpu"):
    """(model, processor) from a local Qwen3.5 directory; the bundled model when `model` is None."""
    from transformers import Qwen3_5ForConditionalGeneration

    from .route_kernels import route_by_device

    model_dir = resolve_model_dir(model)
    read_config(model_dir)
    route_by_device()  # fla-core's kernels for CUDA inputs only: on the CPU transformers' torch functions
    net = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=to_dtype(dtype), device_map=device)
    net.eval()
    return net, load_processor(model_dir)


def load_config(model: str | Path | None = None):
    from transformers import Qwen3_5Config

    model_dir = resolve_model_dir(model)
    read_config(model_dir)
    return Qwen3_5Config.from_pretrained(model_dir)


__all__ = ["load_model", "load_config", "load_processor", "PageProcessor", "DEFAULT_MODEL", "resolve_model_dir"]
