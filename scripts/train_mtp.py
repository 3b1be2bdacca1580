"""Self-distil a model's multi-token-prediction layer (#55): the model frozen, its MTP layer trained to
draft what the model itself emits, for every step of a draft chain.

    python scripts/train_mtp.py ocriaquant/assets/ocria-nano --out /tmp/nano-mtp --pages 1536 --minutes 10

- Pages: the bundled reader's synthetic grid style (ocriaquant.data.synth.GRID_STYLE, 512x512), seeds >= 10**6
  as its training used; the bundled calib_data/ pages (seeds 0-127) are never trained on, and their held-out half
  is what the figures below are measured on.
- Labels: teacher-forced on each page's markdown, the model's own argmax one position later (greedy
  self-distillation: what the verify step compares a draft with), so nothing is decoded.
- Draft steps: `--chain K` steps trained together, each as the runtime chains them (Qwen35MTP.chain: step j
  reads step j-1's output instead of the model's hidden state, over the cache a chain sees); a layer trained on
  step 1 alone drafts its second token right about one time in five.
- Features: the merged input embeddings and final hidden states (model/batched.PageBatchForward), computed once;
  the MTP layer (model/mtp.Qwen35MTP, the model's LM head) trains on them with AdamW for --minutes. Its decoder
  layer starts as a copy of the model's last full-attention layer (same shapes), or from `--init-from`.
- Output: a copy of the model directory with the layer written in (save_mtp), and mtp_training.json (data, steps,
  minutes, held-out share of draft chains right per step and the tokens a verify step would keep). The accepted
  length is measured where it is used: `ocriaquant parse OUT PAGES --spec K` reports it.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ocriaquant.data import DEFAULT_PROMPT, load_pages
from ocriaquant.data.split import is_heldout
from ocriaquant.data.synth import GRID_STYLE, make_page
from ocriaquant.model.batched import PageBatchForward
from ocriaquant.model.load import load_model
from ocriaquant.model.mtp import Qwen35MTP, load_mtp, save_mtp

TRAIN_SEED_BASE = 10**6
TEXT_ROUND = 32  # text lengths padded to a multiple of this: few distinct forward shapes


def page_arrays(pages, tok, end_id: int) -> list[tuple[np.ndarray, list[int]]]:
    """(uint8 [3, H, W] image, target ids ending with <|im_end|>) per page."""
    return [(np.ascontiguousarray(np.asarray(p.image.convert("RGB"), dtype=np.uint8).transpose(2, 0, 1)),
             tok(p.markdown if hasattr(p, "markdown") else p.reference)["input_ids"] + [end_id]) for p in pages]


@torch.no_grad()
def features(model, proc, items, batch: int, label: str) -> list[dict]:
    """Batches of pages (sorted by length) -> per batch what the MTP trains on: emb [B, L-1, D] (position t: the
    embedding of token t+1), hid [B, L-1, D] (the model's final hidden state at t), pos (M-RoPE positions of
    0 .. L-2), and over the text positions p-1 .. L-3: labels [B, T-1] (the model's argmax at t+1) and mask."""
    order = sorted(range(len(items)), key=lambda i: len(items[i][1]))
    fwds: dict[tuple, PageBatchForward] = {}
    out, t0 = [], time.perf_counter()
    for n, s in enumerate(range(0, len(order), batch)):
        group = [items[i] for i in order[s:s + batch]]
        h, w = group[0][0].shape[1:]
        tl = -(-max(len(ids) for _, ids in group) // TEXT_ROUND) * TEXT_ROUND
        key = (h, w, tl)
        if key not in fwds:
            fwds[key] = PageBatchForward(model, proc, (h, w), tl, DEFAULT_PROMPT)
        fwd = fwds[key]
        images = torch.from_numpy(np.stack([img for img, _ in group]))
        ids = torch.zeros(len(group), tl, dtype=torch.long)
        for k, (_, seq) in enumerate(group):
            ids[k, :len(seq)] = torch.tensor(seq)
        mask = torch.arange(tl)[None] < torch.tensor([len(seq) for _, seq in group])[:, None]
        emb, hid = fwd.embeds_hidden(images, ids)
        p = fwd.prefix_len
        argmax = model.lm_head(hid[:, p - 1:-1]).argmax(-1)  # [B, T]: position p-1+i predicts text token i
        out.append({"emb": emb[:, 1:].to(torch.bfloat16), "hid": hid[:, :-1].to(torch.bfloat16),
                    "pos": fwd.position_ids[..., :-1].clone(), "p": p, "labels": argmax[:, 1:], "mask": mask[:, 1:]})
        done = min(s + batch, len(order))
        print(f"  {label} features: {done}/{len(order)} pages, {time.perf_counter() - t0:.0f} s", end="\r", flush=True)
    print()
    return out


def mtp_loss(model, mtp, b: dict, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(cross-entropy averaged over the draft steps, per step whether its draft is right [B, T-1] at each text
    position, False where there is no text) of one feature batch; step j as the runtime's draft chain runs it
    (Qwen35MTP.chain), every step labelled with the model's own token two positions on."""
    emb, hid = b["emb"].float(), b["hid"].float()
    cos_sin = model.model.language_model.rotary_emb(hid, b["pos"].expand(-1, emb.shape[0], -1))
    m = b["mask"].flatten().float()
    ce, right = 0.0, []
    for out in mtp.chain(emb, hid, cos_sin, steps):
        logits = model.lm_head(out[:, b["p"] - 1:-1]).float()  # positions p-1 .. L-3
        ce = ce + (F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="none") * m).sum() / m.sum()
        right.append((logits.argmax(-1) == b["labels"]) & b["mask"])
    return ce / steps, right


def runs(right: list[torch.Tensor]) -> torch.Tensor:
    """Per draft step j, how many chains starting at a text position t have steps 1..j all right (step m's
    draft sits at t+m-1: a chain's drafts are consecutive tokens); [steps]."""
    ok, out = right[0], [right[0].sum()]
    for m, r in enumerate(right[1:], start=1):
        ok = ok[:, :-1] & r[:, m:]  # both empty once the chains outrun the text
        out.append(ok.sum())
    return torch.stack(out)


@torch.no_grad()
def acceptance(model, mtp, batches: list[dict], steps: int) -> tuple[list[float], float]:
    """(per draft step j, the share of text positions whose chain of j drafts is all right; the tokens a
    verify step keeps at k = steps: 1 + their sum). Teacher-forced, so an estimate of what the runtime's
    accepted length measures."""
    got, total = torch.zeros(steps, dtype=torch.long), 0
    for b in batches:
        _, right = mtp_loss(model, mtp, b, steps)
        got, total = got + runs(right), total + int(b["mask"].sum())
    share = [round(float(g) / max(total, 1), 4) for g in got]
    return share, round(1 + sum(share), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="the model directory (its LM head and decoder stay frozen)")
    ap.add_argument("--out", type=Path, required=True, help="a new directory: the model with its MTP layer")
    ap.add_argument("--heldout", type=Path, default=Path("calib_data"),
                    help="pages with markdown; their held-out half is measured (default calib_data)")
    ap.add_argument("--pages", type=int, default=1024, help="training pages rendered (default 1024)")
    ap.add_argument("--minutes", type=float, default=8.0, help="training time budget, features excluded")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--chain", type=int, default=3, help="draft steps trained (as the runtime chains them; default 3)")
    ap.add_argument("--init-from", type=Path, help="a model directory whose MTP layer training starts from "
                    "(default: the decoder layer copied from the model's last full-attention layer)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.out.exists():
        sys.exit(f"error: {args.out} exists; name a new directory")
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)

    model, proc = load_model(args.model, dtype="fp32", device=args.device)
    model.requires_grad_(False)
    tok = proc.tokenizer
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    t_start = time.perf_counter()
    train = page_arrays([make_page(TRAIN_SEED_BASE + i, GRID_STYLE) for i in range(args.pages)], tok, end_id)
    held = [p for p in load_pages(args.heldout).pages if p.reference and is_heldout(p.source.name)]
    if not held:
        sys.exit(f"error: {args.heldout} has no held-out pages with markdown beside them")
    train_b = features(model, proc, train, args.batch, "training")
    held_b = features(model, proc, page_arrays(held, tok, end_id), args.batch, "held-out")
    feat_s = time.perf_counter() - t_start

    lm = model.model.language_model
    last_attn = max(i for i, t in enumerate(model.config.text_config.layer_types) if t == "full_attention")
    if args.init_from:
        mtp = load_mtp(args.init_from, model.config.text_config, torch.float32)
        if mtp is None:
            sys.exit(f"error: {args.init_from} has no MTP layer (no mtp.* tensors) to start from")
        mtp, init = mtp.to(dev), f"the MTP layer of {args.init_from}"
    else:
        mtp = Qwen35MTP(model.config.text_config).to(dev).float()
        mtp.layers[0].load_state_dict(lm.layers[last_attn].state_dict())
        init = f"decoder layer from layer {last_attn}"
    opt = torch.optim.AdamW(mtp.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    before = acceptance(model, mtp, held_b, args.chain)
    print(f"held-out chains right per draft step before training: {before[0]}, ~{before[1]} tokens a verify step")

    budget, t0, step, log = args.minutes * 60, time.perf_counter(), 0, []
    rng = np.random.default_rng(args.seed)
    while time.perf_counter() - t0 < budget:
        for i in rng.permutation(len(train_b)):
            frac = (time.perf_counter() - t0) / budget
            if frac >= 1:
                break
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr
            ce, right = mtp_loss(model, mtp, train_b[i], args.chain)
            opt.zero_grad(set_to_none=True)
            ce.backward()
            torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 50 == 0:
                acc = [round(int(r.sum()) / max(int(train_b[i]["mask"].sum()), 1), 4) for r in right]
                log.append({"step": step, "s": round(time.perf_counter() - t0, 1), "ce": round(ce.item(), 4),
                            "train_agreement": acc})
                print(f"  step {step}: ce {ce.item():.3f}, batch agreement {acc}, {time.perf_counter() - t0:.0f} s",
                      end="\r", flush=True)
    train_s = time.perf_counter() - t0
    after = acceptance(model, mtp, held_b, args.chain)
    print(f"\nheld-out chains right per draft step after {step} steps ({train_s / 60:.1f} min): {after[0]}, "
          f"~{after[1]} tokens a verify step at k = {args.chain}")

    shutil.copytree(args.model, args.out)
    save_mtp(args.out, mtp, torch.bfloat16)
    record = {"model": str(args.model), "pages": args.pages, "style": "grid (ocriaquant.data.synth.GRID_STYLE)",
              "seeds": f"{TRAIN_SEED_BASE}..{TRAIN_SEED_BASE + args.pages - 1}", "heldout_pages": len(held),
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} "
              "threads)", "features_s": round(feat_s, 1), "train_s": round(train_s, 1), "steps": step,
              "batch": args.batch, "lr": args.lr, "chain": args.chain, "init": init,
              "heldout_chains_right_before": before[0], "heldout_chains_right": after[0],
              "heldout_tokens_per_verify_estimate": after[1], "log": log}
    (args.out / "mtp_training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
