"""Model loading, processor, configs and layer groups for Qwen3.5 VLMs."""

from .configs import SHAPES, qwen35_4b_config, tiny_config
from .groups import FORMATS, LayerGroup, decode_bytes, discover_groups, meta_model
from .load import DEFAULT_MODEL, load_config, load_model, resolve_model_dir
from .processor import PageProcessor, build_byte_tokenizer, build_image_processor, chat_text, load_processor

__all__ = [
    "SHAPES", "qwen35_4b_config", "tiny_config", "FORMATS", "LayerGroup", "decode_bytes", "discover_groups",
    "meta_model", "DEFAULT_MODEL", "load_config", "load_model", "resolve_model_dir", "PageProcessor",
    "build_byte_tokenizer", "build_image_processor", "chat_text", "load_processor",
]
