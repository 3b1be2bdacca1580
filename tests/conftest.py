import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

# Two cores on CI: more threads only add contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def load_benchmark():
    """load_benchmark(name): benchmarks/<name>.py as a fresh module. benchmarks/ is not a package: its
    tools import their shared modules (common.py, kernels_harness.py, ...) as top-level names, as
    they do when run as `python benchmarks/<name>.py`, so benchmarks/ goes on sys.path."""
    root = Path(__file__).parents[1] / "benchmarks"
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, root / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen3.5 VLM saved with its processor, as a user's model directory would be."""
    from transformers import Qwen3_5ForConditionalGeneration

    from ocriaquant.model import tiny_config
    from ocriaquant.model.processor import save_processor
    from ocriaquant.model.reference import reference_processor

    out = tmp_path_factory.mktemp("tiny-qwen35")
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(tiny_config()).save_pretrained(out)
    save_processor(reference_processor(max_pixels=256 * 320), out)
    return out


@pytest.fixture(scope="session")
def synth_pages(tmp_path_factory):
    from ocriaquant.data.synth import SynthStyle, write_pages

    out = tmp_path_factory.mktemp("pages")
    write_pages(out, 6, seed=1, style=SynthStyle(width=256, height=320, font_size=12, heading_size=16,
                                                 subheading_size=14, margin=16))
    return out


@pytest.fixture(scope="session")
def mixed_checkpoint(tmp_path_factory):
    """The bundled model exported with a mixed FP8 / NVFP4 plan (h200: weight-only NVFP4)."""
    from ocriaquant.artifacts import model_fingerprint
    from ocriaquant.export import export
    from ocriaquant.model import DEFAULT_MODEL, discover_groups, load_config, meta_model

    tmp = tmp_path_factory.mktemp("mixed")
    groups = discover_groups(meta_model(load_config(DEFAULT_MODEL)))
    fmt = {"mlp_up": "nvfp4", "mlp_down": "nvfp4", "gdn_in": "fp8", "gdn_out": "fp8", "attn_qkv": "fp8",
           "attn_o": "fp8"}
    plan = {g.name: fmt.get(g.kind, "bf16") for g in groups if not g.always_bf16}
    (tmp / "plan.json").write_text(json.dumps({"target": "h200", "groups": plan, "model_dir": str(DEFAULT_MODEL),
                                               "calibration": {"fingerprint": model_fingerprint(DEFAULT_MODEL)}}))
    return export(tmp / "plan.json", tmp / "ckpt", max_pages=2, verify_pages=0)
