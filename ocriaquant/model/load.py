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


class PagesNotModel(OcriaError):
    """A folder of pages given where a model directory is expected (the CLI suggests the command)."""

    def __init__(self, path: Path, pages: int):
        self.path, self.pages = path, pages
        super().__init__(f"{path}: a folder of {pages} page{'s' if pages != 1 else ''}, not a model directory "
                         "(it has no config.json)")


def _count_pages(folder: Path) -> int:
    from ..data.listing import IMAGE_EXTS, PDF_EXTS

    if (folder / "metadata.jsonl").is_file():  # a `datasets` imagefolder
        return sum(1 for line in (folder / "metadata.jsonl").open() if line.strip())
    return sum(1 for f in folder.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_EXTS | PDF_EXTS)


def resolve_model_dir(model: str | Path | None, *, weights: bool = True) -> Path:
    """The model directory `model` names (None: the bundled model), checked: a directory (not a
    folder of pages) with a Qwen3.5 config.json and, unless `weights=False`, all its weights."""
    path = Path(model) if model else DEFAULT_MODEL
    if not path.is_dir():
        hint = " (model ids are not downloaded: pass a local directory)" if model and "/" in str(model) else ""
        raise OcriaError(f"{path}: not a directory{hint}")
    if not (path / "config.json").is_file() and (pages := _count_pages(path)):
        raise PagesNotModel(path, pages)
    read_config(path)
    if weights:
        require_weights(path)
    return path


def _lfs_pointer_or_empty(f: Path) -> str | None:
    size = f.stat().st_size
    if size > 1024:
        return None
    with open(f, "rb") as fh:
        head = fh.read(64)
    if head.startswith(b"version https://git-lfs"):
        return "pointer"
    return "empty" if size < 8 else None


def weights_problem(model_dir: str | Path) -> str | None:
    """Why the weights of `model_dir` cannot be read (None: they are all there): no
    *.safetensors, shards its index lists missing, Git LFS pointers instead of files."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            return f"{index.name} is unreadable ({type(e).__name__}: {e})"
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            return (f"{len(missing)} of the {len(shards)} weight files {index.name} lists are missing "
                    f"({', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}): an unfinished copy or download?")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = sorted(model_dir.glob("*.bin"))
        if bins:
            return (f"no *.safetensors weights, only PyTorch {bins[0].name}: ocriaquant reads safetensors "
                    "(transformers' save_pretrained writes them)")
        return "no weights (config.json, but no *.safetensors files)"
    for f in files:
        kind = _lfs_pointer_or_empty(f)
        if kind == "pointer":
            return f"{f.name} is a Git LFS pointer, not the weights: run `git lfs pull` in {model_dir}"
        if kind == "empty":
            return f"{f.name} is empty: copy or download it again"
    return None


def require_weights(model_dir: str | Path) -> None:
    if problem := weights_problem(model_dir):
        raise OcriaError(f"{model_dir}: {problem}. This needs the model's weights; only `ocriaquant info` "
                         "works from config.json alone")


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
    route_by_device()  # fla-core's kernels for CUDA inputs only: on the CPU transformers' torch functions
    net = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=to_dtype(dtype), device_map=device)
    net.eval()
    return net, load_processor(model_dir)


def load_config(model: str | Path | None = None):
    from transformers import Qwen3_5Config

    """The config alone: a directory without weights is fine here (`ocriaquant info`)."""
    model_dir = resolve_model_dir(model, weights=False)
    return Qwen3_5Config.from_pretrained(model_dir)


__all__ = ["load_model", "load_config", "load_processor", "PageProcessor", "DEFAULT_MODEL", "resolve_model_dir",
           "PagesNotModel", "weights_problem", "require_weights"]
