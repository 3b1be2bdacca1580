"""The Qwen3.5 processor, built from its parts.

transformers' `AutoProcessor` for Qwen3.5 wants a video processor, which needs torchvision,
which does not import beside the CPU torch wheel. We never process video, so we build the
processor from the PIL image processor and the tokenizer. Doing this everywhere (GPU
machines too) also keeps image preprocessing identical across machines: the torchvision and
PIL resizers do not give the same pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor

SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

SYSTEM_PROMPT = "You are a document parser. Write the page as markdown."

# Qwen's chat layout reduced to what a page parser needs: system, user (image + text), assistant.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class PageProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without a video processor (see module docstring)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def build_byte_tokenizer():
    """A byte-level tokenizer of Qwen3.5's own class with no merges: one token per byte.

    Small models trained here use it; a vocabulary of 263 keeps the embedding tiny and
    needs no training data or download.
    """
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    vocab = {"<|endoftext|>": 0}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Qwen3_5Tokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_image_processor(max_pixels: int = 512 * 640, min_pixels: int = 64 * 64, patch_size: int = 16,
                          merge_size: int = 2) -> Qwen2VLImageProcessorPil:
    # `size` is what the PIL processor reads; min/max pixels bound the resized page area.
    return Qwen2VLImageProcessorPil(
        patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )


def load_processor(model_dir: Path) -> PageProcessor:
    model_dir = Path(model_dir)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    template = tokenizer.chat_template
    tmpl_file = model_dir / "chat_template.jinja"
    if template is None and tmpl_file.exists():
        template = tmpl_file.read_text(encoding="utf-8")
    proc_cfg = model_dir / "processor_config.json"
    if template is None and proc_cfg.exists():
        template = json.loads(proc_cfg.read_text()).get("chat_template")
    return PageProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                         chat_template=template or CHAT_TEMPLATE)


def save_processor(processor: PageProcessor, out_dir: Path) -> None:
    """Write the parts a loader needs (tokenizer, image processor, chat template)."""
    out_dir = Path(out_dir)
    processor.tokenizer.save_pretrained(out_dir)
    processor.image_processor.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(processor.chat_template, encoding="utf-8")


def chat_text(processor: PageProcessor, prompt: str, system: str | None = SYSTEM_PROMPT) -> str:
    """The text of one page request up to the assistant turn (image placeholder included)."""
    messages = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]})
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_page(processor: PageProcessor, page, pixel_dtype=None) -> dict:
    """One page's request: input ids, attention mask, `mm_token_type_ids` (1 on image tokens:
    Qwen3.5's forward needs them), pixel values and the image grid. pixel_dtype: the pixels cast
    here, for a vision tower that casts them to it first thing (the runtime's, in BF16): the same
    values, half the bytes in memory, across a reader's pipe and to the GPU."""
    enc = dict(processor(images=[page.image], text=[chat_text(processor, page.prompt)], return_tensors="pt"))
    if pixel_dtype is not None and "pixel_values" in enc:
        enc["pixel_values"] = enc["pixel_values"].to(pixel_dtype)
    return enc


class PageEncoder:
    """A picklable factory for data/stream.py's workers: `PageEncoder(model_dir)()` loads the
    model's processor once in the worker and returns Page -> request."""

    def __init__(self, model_dir: Path, pixel_dtype=None):
        self.model_dir, self.pixel_dtype = Path(model_dir), pixel_dtype

    def __call__(self):
        processor = load_processor(self.model_dir)
        return lambda page: encode_page(processor, page, self.pixel_dtype)
