"""Greedy page decoding through transformers' own `generate` (the reference every other
decoder in ocriaquant is compared against)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..data.page import Page
from .processor import PageProcessor, chat_text


def default_max_new_tokens(tokenizer, pages: Sequence[Page]) -> int:
    """Room for the longest ground truth among `pages` plus a quarter, so a model that runs
    on past it is still seen to, without decoding 512 tokens a page."""
    return int(max(len(tokenizer(p.reference or "")["input_ids"]) for p in pages) * 1.25) + 16


@torch.no_grad()
def greedy_decode(model, processor: PageProcessor, pages: Sequence[Page], batch_size: int = 16,
                  max_new_tokens: int = 512, on_batch: Callable[[int], None] | None = None) -> list[str]:
    """Markdown for each page, greedy. Pages of different sizes batch fine: prompts are
    left-padded, and `mm_token_type_ids` travels with the inputs so image positions are right."""
    tok = processor.tokenizer
    old_side, tok.padding_side = tok.padding_side, "left"
    device = next(model.parameters()).device
    out_texts: list[str] = []
    try:
        for i in range(0, len(pages), batch_size):
            chunk = pages[i: i + batch_size]
            enc = processor(images=[p.image for p in chunk], text=[chat_text(processor, p.prompt) for p in chunk],
                            return_tensors="pt", padding=True).to(device)
            if "pixel_values" in enc:
                enc["pixel_values"] = enc["pixel_values"].to(model.dtype)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            new = out[:, enc["input_ids"].shape[1]:]
            out_texts += [t.strip() for t in tok.batch_decode(new, skip_special_tokens=True)]
            if on_batch:
                on_batch(len(chunk))
    finally:
        tok.padding_side = old_side
    return out_texts
