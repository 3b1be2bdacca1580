"""Qwen3.5 configurations: tiny ones for tests and the bundled model, real shapes for benches."""

from __future__ import annotations

from transformers import Qwen3_5Config

from .processor import SPECIAL_TOKENS

# Byte tokenizer layout (processor.build_byte_tokenizer): 0 = <|endoftext|>, 1..256 bytes,
# then the special tokens in SPECIAL_TOKENS order.
BYTE_VOCAB = 257 + len(SPECIAL_TOKENS)
_SPECIAL_ID = {tok: 257 + i for i, tok in enumerate(SPECIAL_TOKENS)}


def _rope(head_dim: int, partial: float = 0.25) -> dict:
    # Qwen3.5 uses interleaved M-RoPE over (t, h, w) on a quarter of the head dim.
    rot_half = int(head_dim * partial) // 2
    t = rot_half - 2 * (rot_half // 4)
    section = [t, rot_half // 4, rot_half // 4]
    return {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": partial,
            "mrope_section": section, "mrope_interleaved": True}


def tiny_config(
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 4,
    attn_heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 32,
    gdn_k_heads: int = 2,
    gdn_v_heads: int = 4,
    gdn_head_dim: int = 16,
    vision_depth: int = 2,
    vision_hidden: int = 32,
    vocab: int = BYTE_VOCAB,
) -> Qwen3_5Config:
    """A Qwen3.5 VLM small enough for CPU tests, with the byte tokenizer's special ids."""
    text = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=attn_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_key_head_dim=gdn_head_dim, linear_value_head_dim=gdn_head_dim,
        linear_num_key_heads=gdn_k_heads, linear_num_value_heads=gdn_v_heads,
        tie_word_embeddings=True, max_position_embeddings=4096, rope_parameters=_rope(head_dim),
        eos_token_id=_SPECIAL_ID["<|im_end|>"], pad_token_id=0, bos_token_id=None,
    )
    vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                  num_heads=max(1, vision_hidden // 32), out_hidden_size=hidden, num_position_embeddings=1024,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    return Qwen3_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=True,
        image_token_id=_SPECIAL_ID["<|image_pad|>"], video_token_id=_SPECIAL_ID["<|video_pad|>"],
        vision_start_token_id=_SPECIAL_ID["<|vision_start|>"], vision_end_token_id=_SPECIAL_ID["<|vision_end|>"],
    )


def qwen35_4b_config() -> Qwen3_5Config:
    """Qwen3.5-4B shapes (DESIGN.md): for `info`, benches and memory estimates on the meta device."""
    text = dict(
        vocab_size=248320, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        tie_word_embeddings=True, rope_parameters=_rope(256), max_position_embeddings=262144,
        eos_token_id=248046, pad_token_id=248044,
    )
    vision = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
                  num_position_embeddings=2304, patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)


def qwen35_08b_config() -> Qwen3_5Config:
    text = dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16,
        tie_word_embeddings=True, rope_parameters=_rope(256), max_position_embeddings=262144,
        eos_token_id=248046, pad_token_id=248044,
    )
    vision = dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, out_hidden_size=1024,
                  num_position_embeddings=2304, patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)


SHAPES = {"qwen3.5-4b": qwen35_4b_config, "qwen3.5-0.8b": qwen35_08b_config}


def use_tokenizer_ids(config: Qwen3_5Config, tok) -> Qwen3_5Config:
    """The real shapes carry Qwen's 248k-vocab special ids; point them at `tok`'s (the byte
    tokenizer of random-weight benches), so its processor's image tokens are the model's."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                      "<|vision_end|>", "<|im_end|>")}
    config.image_token_id, config.video_token_id = ids["<|image_pad|>"], ids["<|video_pad|>"]
    config.vision_start_token_id, config.vision_end_token_id = ids["<|vision_start|>"], ids["<|vision_end|>"]
    config.text_config.eos_token_id, config.text_config.pad_token_id = ids["<|im_end|>"], 0
    return config
