import numpy as np
import torch

from ocriaquant.data.synth import SynthStyle, make_page
from ocriaquant.model import chat_text, load_model
from ocriaquant.model.batched import PageBatchForward, patchify

STYLE = SynthStyle(width=256, height=320, font_size=12, heading_size=16, subheading_size=14, margin=16)


def test_patchify_matches_processor(tiny_model_dir):
    _, proc = load_model(tiny_model_dir, dtype="fp32")
    pages = [make_page(s, STYLE).image for s in (1, 2)]
    ref = proc.image_processor(images=pages, return_tensors="pt")["pixel_values"]
    imgs = torch.from_numpy(np.stack([np.asarray(p) for p in pages])).permute(0, 3, 1, 2)
    ip = proc.image_processor
    ours = patchify(imgs, ip.patch_size, ip.merge_size, ip.temporal_patch_size, torch.tensor(ip.image_mean),
                    torch.tensor(ip.image_std))
    torch.testing.assert_close(ours.reshape(-1, ours.shape[-1]), ref, rtol=1e-5, atol=1e-5)


def test_batched_forward_equals_transformers(tiny_model_dir):
    model, proc = load_model(tiny_model_dir, dtype="fp32")
    pages = [make_page(s, STYLE) for s in (3, 4)]
    texts = [p.markdown[:40] for p in pages]
    text_len = 40
    fwd = PageBatchForward(model, proc, (320, 256), text_len, prompt="Convert this page to markdown.")
    ids = torch.stack([torch.tensor(proc.tokenizer(t)["input_ids"]) for t in texts])
    assert ids.shape == (2, text_len)
    imgs = torch.from_numpy(np.stack([np.asarray(p.image) for p in pages])).permute(0, 3, 1, 2)
    with torch.no_grad():
        ours = fwd(imgs, ids)
        prompt = chat_text(proc, "Convert this page to markdown.")
        enc = proc(images=[p.image for p in pages], text=[prompt + t for t in texts], return_tensors="pt")
        ref = model(**enc).logits[:, fwd.prefix_len - 1: -1]
    assert torch.equal(enc["input_ids"][:, fwd.prefix_len:], ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
