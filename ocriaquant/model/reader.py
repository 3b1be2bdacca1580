"""The document reader (issue #57): a ~19 M-parameter Qwen3.5 VLM that reads ordinary pages.

The successor of ocria-nano (`reference.py`, which reads only its own monospace grid). Same
block structure as Qwen3.5-4B, sized to what reading proportional print needs and to ship in
the repository (<= 40 MB of BF16 weights, the MTP layer included):

    text    hidden 320, intermediate 768, 8 layers (GDN, GDN, GDN, attention) x 2,
            gated attention 4q / 2kv heads of 64, GDN 2 key / 4 value heads of 64, conv 4,
            tied embeddings, vocabulary 8,192 (byte-level BPE, below)
    vision  depth 6, hidden 256, MLP 1,024, 4 heads of 64, patch 16, 2x2 merge; pages up to
            768 x 1024 px unresized (3,072 patches -> 768 image tokens)
    mtp     one layer (Qwen3.5's `mtp.*`: fc, two pre-fc norms, a full-attention decoder layer, norm)

Tokenizer: Qwen3.5's tokenizer class (its pre-tokenizer: digits one by one, byte-level), with
BPE merges trained on the document generator's markdown: ~3.5 characters a token, where the
byte tokenizer of ocria-nano spends one token a byte (a byte-level toy overstates what a real
tokenizer accepts, and makes pages 3-4x longer to decode). Special tokens as Qwen's, ids 0-6.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import torch

from .configs import tiny_config, use_tokenizer_ids
from .processor import CHAT_TEMPLATE, PageProcessor, build_byte_tokenizer, build_image_processor

READER_MAX_PIXELS = 768 * 1024  # the largest generated page goes in unresized


@dataclass(frozen=True)
class ReaderShape:
    hidden: int = 320
    intermediate: int = 768
    layers: int = 8
    attn_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    gdn_k_heads: int = 2
    gdn_v_heads: int = 4
    gdn_head_dim: int = 64
    vision_depth: int = 6
    vision_hidden: int = 256
    vision_intermediate: int = 1024
    vision_heads: int = 4
    vocab: int = 8192
    mtp_layers: int = 1


def reader_config(tokenizer, shape: ReaderShape = ReaderShape()):
    """The Qwen3_5Config of the reader for `tokenizer` (its special ids; vocabulary rounded up to 64)."""
    vocab = max(shape.vocab, len(tokenizer))
    vocab = (vocab + 63) // 64 * 64
    s = asdict(shape)
    cfg = tiny_config(hidden=s["hidden"], intermediate=s["intermediate"], layers=s["layers"],
                      attn_heads=s["attn_heads"], kv_heads=s["kv_heads"], head_dim=s["head_dim"],
                      gdn_k_heads=s["gdn_k_heads"], gdn_v_heads=s["gdn_v_heads"], gdn_head_dim=s["gdn_head_dim"],
                      vision_depth=s["vision_depth"], vision_hidden=s["vision_hidden"], vocab=vocab)
    cfg.vision_config.intermediate_size = shape.vision_intermediate
    cfg.vision_config.num_heads = shape.vision_heads
    cfg = use_tokenizer_ids(cfg, tokenizer)
    cfg.text_config.mtp_num_hidden_layers = shape.mtp_layers
    cfg.text_config.mtp_use_dedicated_embeddings = False
    return cfg


def train_reader_tokenizer(texts: Iterable[str], vocab_size: int = 8192):
    """Byte-level BPE of Qwen3.5's tokenizer class, merges learned from `texts`.

    Starts from the byte tokenizer (Qwen's pre-tokenizer and byte-level decoder, Qwen's special
    tokens) and learns `vocab_size` - 263 merges; every byte string stays encodable and decodes
    back exactly (checked on `texts`)."""
    texts = list(texts)
    base = build_byte_tokenizer()
    tok = base.train_new_from_iterator(texts, vocab_size=vocab_size)
    tok.chat_template = CHAT_TEMPLATE
    for t in texts[:200]:
        if tok.decode(tok(t)["input_ids"]) != t:
            raise AssertionError(f"the trained tokenizer does not round-trip {t[:80]!r}")
    return tok


def reader_processor(tokenizer, max_pixels: int = READER_MAX_PIXELS) -> PageProcessor:
    return PageProcessor(image_processor=build_image_processor(max_pixels=max_pixels), tokenizer=tokenizer,
                         video_processor=None, chat_template=tokenizer.chat_template or CHAT_TEMPLATE)


def count_parameters(config, with_mtp: bool = True) -> dict[str, int]:
    """Parameters of the reader by part, on the meta device (no memory)."""
    from transformers import Qwen3_5ForConditionalGeneration

    from .mtp import Qwen35MTP

    with torch.device("meta"):
        m = Qwen3_5ForConditionalGeneration(config)
        mtp = Qwen35MTP(config.text_config) if with_mtp else None
    vision = sum(p.numel() for n, p in m.named_parameters() if ".visual." in f".{n}")
    total = sum(p.numel() for p in m.parameters())
    out = {"vision": vision, "text": total - vision, "mtp": sum(p.numel() for p in mtp.parameters()) if mtp else 0}
    out["total"] = total + out["mtp"]
    return out


def init_reader(out_dir: Path, tokenizer, shape: ReaderShape = ReaderShape(), seed: int = 0,
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a freshly initialized reader (weights, MTP layer, processor) to `out_dir`."""
    from transformers import Qwen3_5ForConditionalGeneration

    from .mtp import Qwen35MTP, save_mtp
    from .processor import save_processor

    torch.manual_seed(seed)
    cfg = reader_config(tokenizer, shape)
    model = Qwen3_5ForConditionalGeneration(cfg).to(dtype)
    mtp = Qwen35MTP(model.config.text_config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, max_shard_size="12MB")
    save_mtp(out_dir, mtp, dtype)
    save_processor(reader_processor(tokenizer), out_dir)
    return out_dir
