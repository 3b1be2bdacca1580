"""The bundled reference model's architecture: a ~10 M-parameter Qwen3.5 VLM.

Same block structure as Qwen3.5-4B (3 GDN : 1 attention, fused units, tied embeddings,
ViT with 2x2 merge), scaled down so it ships in the wheel (< 25 MB in BF16) and runs on a
CPU in seconds. It reads the byte tokenizer built in processor.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .configs import tiny_config
from .processor import PageProcessor, build_byte_tokenizer, build_image_processor, save_processor

PAGE_PIXELS = 512 * 640  # the bundled pages' size: 32x40 patches -> 320 image tokens


def reference_config():
    return tiny_config(hidden=256, intermediate=768, layers=8, attn_heads=4, kv_heads=2, head_dim=64,
                       gdn_k_heads=2, gdn_v_heads=4, gdn_head_dim=64, vision_depth=4, vision_hidden=256)


def reference_processor(max_pixels: int = PAGE_PIXELS) -> PageProcessor:
    tok = build_byte_tokenizer()
    return PageProcessor(image_processor=build_image_processor(max_pixels=max_pixels), tokenizer=tok,
                         video_processor=None, chat_template=tok.chat_template)


def init_reference(out_dir: Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a freshly initialized reference model + processor to `out_dir`."""
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(reference_config()).to(dtype)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    save_processor(reference_processor(), out_dir)
    return out_dir
