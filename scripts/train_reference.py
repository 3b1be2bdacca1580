"""Train the document reader (issue #57) on document pages drawn on the fly.

    # on a GPU: one command, resumable, time-budgeted (GPU-minutes in all, across runs)
    python scripts/train_reference.py --work /tmp/train --minutes 50 --stop-after 22 --judge judge_pages/
    python scripts/train_reference.py --work /tmp/train --minutes 50 --resume-from PACK_DIR ...  # next machine
    python scripts/train_reference.py --unpack PACK_DIR --out DIR   # the model directory from a pack (CPU)
    # on a CPU, a few steps of a tiny reader (the smoke test)
    python scripts/train_reference.py --work /tmp/t --tiny --device cpu --steps 4 --sizes 256x320

The reader: ocriaquant.model.reader (Qwen3.5 block structure, ~19 M parameters with its MTP
layer, a byte-level BPE tokenizer trained here on the generator's markdown, saved in --work and
reused on resume). The data: ocriaquant.data.docgen pages, one seeded stream (training seeds
>= 10**6; the held-out pages this script decodes are seeds 0..N-1, and the second renderer's pages
(`--judge DIR`, ocriaquant.data.typeset) are never trained on), rendered by worker processes into a
pool on the GPU per page size; finished pages replace the oldest in the pool while training runs,
so every step reads pages already there and the GPU never waits on rendering.

The step: per page size a static batch (positions, vision rotary and position-embedding
interpolation computed once, ocriaquant.model.batched), forward, loss (next token + the MTP layer's
next-next token, weight --mtp-weight), backward, clip, fused AdamW, all captured in one CUDA graph
per page size (one memory pool shared). GDN's chunked delta rule runs the fastest implementation
that agrees with transformers' torch function in fp32, forward and backward, on this machine
(ocriaquant.model.gdn_train.select: fla-core's kernels, fla with a 32-wide K tile in the backward
where Triton 3.4-3.7.0 miscompiles fla's on Hopper, fla forward + torch backward, or torch); the
choice and its timings go to the log.

Resumable: --work/state.pt (fp32 weights, optimizer, stream position, clocks) every --save-every
steps or --save-minutes and at the end, for a restart on the same machine (--resume); and a pack (--work/pack/:
BF16 weights with their high bytes compressed, tokenizer, config, training record; parts of <= 15
MiB) for the next machine (--resume-from PACK: fresh optimizer with a short warm-up, same
schedule, same stream). --minutes is wall time in all across runs (setup, evaluations and saves
included: GPU-minutes), --stop-after ends this run early, state saved. `--out DIR` (or --unpack)
writes the model directory: BF16 weights + `mtp.*`, processor files, training.json and a model card.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import json
import math
import os
import shutil
import sys
import time
import zlib
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ocriaquant.data import DEFAULT_PROMPT, Page, load_pages
from ocriaquant.data.docgen import DOC_STYLE, DocStyle, make_doc_page
from ocriaquant.model.batched import PageBatchForward
from ocriaquant.model.processor import save_processor
from ocriaquant.model.reader import (READER_MAX_PIXELS, ReaderShape, count_parameters, reader_config,
                                     reader_processor, train_reader_tokenizer)

TRAIN_SEED_BASE = 10**6
TINY = ReaderShape(hidden=64, intermediate=128, layers=4, attn_heads=2, kv_heads=1, head_dim=32, gdn_k_heads=1,
                   gdn_v_heads=2, gdn_head_dim=32, vision_depth=1, vision_hidden=64, vision_intermediate=128,
                   vision_heads=2, vocab=512)
PACK_PART = 15 * 2**20


# ---------------------------------------------------------------------------------------------
# Pages


def _render(job: tuple[int, int, DocStyle]) -> tuple[int, int, np.ndarray | None, str]:
    """(bucket, seed, CHW uint8 image, markdown), or (bucket, seed, None, the error) where the generator
    fails on this seed: one bad page must not end a GPU run (the pool skips it and the log names it)."""
    bucket, seed, style = job
    try:
        page = make_doc_page(seed, style)
    except Exception as e:  # noqa: BLE001 - any generator bug; re-raised for held-out pages
        return bucket, seed, None, f"{type(e).__name__}: {e}"
    return bucket, seed, np.ascontiguousarray(np.asarray(page.image, dtype=np.uint8).transpose(2, 0, 1)), page.markdown


class PageStream:
    """Training page i: seed TRAIN_SEED_BASE + stream * 10**7 + i, page size bucket_of(i) (a
    low-discrepancy sequence over the size weights, so the mix is exact over any window)."""

    def __init__(self, stream: int, styles: list[DocStyle], weights: list[float]):
        self.stream, self.styles = stream, styles
        total = sum(weights)
        self.cum = list(np.cumsum([w / total for w in weights]))

    def bucket_of(self, i: int) -> int:
        return min(bisect.bisect_right(self.cum, (i * 0.6180339887498949 + 0.5 * self.stream) % 1.0),
                   len(self.styles) - 1)

    def job(self, i: int) -> tuple[int, int, DocStyle]:
        b = self.bucket_of(i)
        return b, TRAIN_SEED_BASE + self.stream * 10**7 + i, self.styles[b]


class PagePool:
    """Per page size: `size` pages on the device (uint8 images, token ids, masks), refreshed
    from the stream by worker processes while training runs."""

    def __init__(self, stream: PageStream, sizes: list[tuple[int, int]], pool_sizes: list[int], executor,
                 device, next_index: int, in_flight: int):
        self.stream, self.sizes, self.device, self.ex = stream, sizes, device, executor
        self.cap = pool_sizes
        self.images = [torch.zeros(n, 3, h, w, dtype=torch.uint8, device=device) for n, (w, h) in
                       zip(pool_sizes, sizes)]
        self.ids: list[torch.Tensor | None] = [None] * len(sizes)
        self.mask: list[torch.Tensor | None] = [None] * len(sizes)
        self.filled = [0] * len(sizes)
        self.ptr = [0] * len(sizes)
        self.next_index = next_index
        self.max_in_flight = in_flight
        self.futures: deque = deque()
        self.rendered = 0
        self.dropped = 0
        self.failed: list[tuple[int, str]] = []  # (seed, error) of pages the generator failed on
        self.tok = None
        self.text_len: list[int] = []
        self.end_id = None

    def submit(self) -> None:
        while len(self.futures) < self.max_in_flight:
            self.futures.append(self.ex.submit(_render, self.stream.job(self.next_index)))
            self.next_index += 1

    def collect(self, block: bool = False, limit: int | None = None) -> list[tuple[int, int, np.ndarray, str]]:
        """Finished pages in stream order (stops at the first unfinished one unless block); pages
        the generator failed on are left out and kept in `failed`."""
        out = []
        while self.futures and (block or self.futures[0].done()) and (limit is None or len(out) < limit):
            b, seed, img, md = self.futures.popleft().result()
            if img is None:
                self.failed.append((seed, md))
            else:
                out.append((b, seed, img, md))
        return out

    def set_tokenizer(self, tok, end_id: int, text_len: list[int]) -> None:
        self.tok, self.end_id, self.text_len = tok, end_id, text_len
        self.ids = [torch.zeros(n, t, dtype=torch.long, device=self.device) for n, t in zip(self.cap, text_len)]
        self.mask = [torch.zeros(n, t, dtype=torch.bool, device=self.device) for n, t in zip(self.cap, text_len)]

    def insert(self, pages: list[tuple[int, int, np.ndarray, str]]) -> None:
        by_bucket: dict[int, list] = {}
        for b, _, img, md in pages:
            seq = self.tok(md)["input_ids"] + [self.end_id]
            self.rendered += 1
            if len(seq) > self.text_len[b]:
                self.dropped += 1
                continue
            by_bucket.setdefault(b, []).append((img, seq))
        for b, items in by_bucket.items():
            n = len(items)
            slots = [(self.ptr[b] + k) % self.cap[b] for k in range(n)][-self.cap[b]:]
            items = items[-self.cap[b]:]
            self.ptr[b] = (self.ptr[b] + n) % self.cap[b]
            self.filled[b] = min(self.cap[b], self.filled[b] + n)
            imgs = torch.from_numpy(np.stack([i for i, _ in items]))
            ids = torch.zeros(len(items), self.text_len[b], dtype=torch.long)
            for k, (_, seq) in enumerate(items):
                ids[k, : len(seq)] = torch.tensor(seq)
            mask = torch.arange(self.text_len[b])[None] < torch.tensor([len(s) for _, s in items])[:, None]
            idx = torch.tensor(slots)
            if self.device.type == "cuda":  # pinned and non-blocking: the host never waits for the step in flight
                imgs, ids, mask, idx = imgs.pin_memory(), ids.pin_memory(), mask.pin_memory(), idx.pin_memory()
            idx = idx.to(self.device, non_blocking=True)
            self.images[b].index_copy_(0, idx, imgs.to(self.device, non_blocking=True))
            self.ids[b].index_copy_(0, idx, ids.to(self.device, non_blocking=True))
            self.mask[b].index_copy_(0, idx, mask.to(self.device, non_blocking=True))

    def full(self) -> bool:
        return all(f >= c for f, c in zip(self.filled, self.cap))


def held_out_pages(n: int, style: DocStyle, executor) -> list[Page]:
    """Own held-out pages: seeds 0..n-1 of the document generator (training seeds are >= 10**6)."""
    jobs = [(0, s, style) for s in range(n)]
    out = []
    for _, seed, img, md in executor.map(_render, jobs):
        from PIL import Image

        if img is None:
            raise SystemExit(f"held-out page {seed}: the document generator failed ({md}); fix "
                             "ocriaquant/data/docgen.py before training")

        out.append(Page(image=Image.fromarray(img.transpose(1, 2, 0)), source=Path(f"doc-{seed:04d}.png"),
                        reference=md))
    return out


# ---------------------------------------------------------------------------------------------
# The forward


def step_loss(fwd: PageBatchForward, model, mtp, images, ids, mask, mtp_weight: float):
    """(total loss, [next-token CE, MTP CE, MTP top-1 accuracy]) for one batch."""
    emb, hid = fwd.embeds_hidden(images, ids)
    p = fwd.prefix_len
    logits = model.lm_head(hid[:, p - 1: -1])
    m = mask.flatten().float()
    ce = (F.cross_entropy(logits.float().flatten(0, 1), ids.flatten(), reduction="none") * m).sum() / m.sum()
    if mtp is None or mtp_weight <= 0:
        zero = ce.detach() * 0
        return ce, torch.stack([ce.detach(), zero, zero])
    b = images.shape[0]
    # MTP at position t: embedding of token t+1 and hidden h_t, predicting token t+2. Positions
    # p-1 .. L-3 predict text tokens 1 .. T-1.
    lm = model.model.language_model
    pos = fwd.position_ids[..., :-1].expand(-1, b, -1)
    cos_sin = lm.rotary_emb(hid, pos)
    mh = mtp(emb[:, 1:], hid[:, :-1], cos_sin)
    mlog = model.lm_head(mh[:, p - 1: -1])
    tgt, mm = ids[:, 1:], mask[:, 1:]
    mmf = mm.flatten().float()
    mce = (F.cross_entropy(mlog.float().flatten(0, 1), tgt.flatten(), reduction="none") * mmf).sum() / mmf.sum()
    acc = ((mlog.argmax(-1) == tgt) & mm).float().sum() / mmf.sum()
    return ce + mtp_weight * mce, torch.stack([ce.detach(), mce.detach(), acc.detach()])


# ---------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(model, proc, pages: list[Page], batch: int) -> dict:
    """Greedy-decode pages in BF16 through transformers' generate (what `ocriaquant eval` runs)."""
    from ocriaquant.eval import bootstrap_mean, ned
    from ocriaquant.model.generate import default_max_new_tokens, greedy_decode

    m = copy.deepcopy(model).to(torch.bfloat16).eval()
    preds = greedy_decode(m, proc, pages, batch_size=batch,
                          max_new_tokens=default_max_new_tokens(proc.tokenizer, pages))
    del m
    scores = [ned(p, pg.reference) for p, pg in zip(preds, pages)]
    ci = bootstrap_mean(scores)
    order = np.argsort(scores)[::-1][:3]
    return {"pages": len(pages), "ned": round(ci.estimate, 5), "ned_low": round(ci.low, 5),
            "ned_high": round(ci.high, 5), "worst": [[pages[i].name, round(scores[i], 4)] for i in order],
            "sample": preds[0][:160]}


# ---------------------------------------------------------------------------------------------
# State: same-machine (state.pt) and next-machine (pack)


def save_pack(pack_dir: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """BF16 tensors as two byte planes (high bytes zlib-compressed, ~35 %; low bytes raw) plus a
    JSON header, cut into parts of <= 15 MiB: what comes back from a GPU machine and is carried to
    the next one (their file and tree size limits)."""
    names = sorted(tensors)
    flat = torch.cat([tensors[k].to(torch.bfloat16).contiguous().flatten().view(torch.int16) for k in names])
    b = flat.numpy().view(np.uint8).reshape(-1, 2)
    hi = zlib.compress(b[:, 1].tobytes(), 6)
    lo = b[:, 0].tobytes()
    header = dict(meta, tensors=[[k, list(tensors[k].shape)] for k in names], hi_bytes=len(hi), lo_bytes=len(lo))
    hb = json.dumps(header).encode()
    blob = len(hb).to_bytes(8, "little") + hb + hi + lo
    tmp = pack_dir.with_name(pack_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for k in range(0, len(blob), PACK_PART):
        (tmp / f"pack.{k // PACK_PART:03d}").write_bytes(blob[k: k + PACK_PART])
    shutil.rmtree(pack_dir, ignore_errors=True)
    os.replace(tmp, pack_dir)


def load_pack(pack_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    parts = sorted(Path(pack_dir).glob("pack.[0-9][0-9][0-9]"))
    if not parts:
        raise SystemExit(f"{pack_dir}: no pack.NNN parts")
    blob = b"".join(p.read_bytes() for p in parts)
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8: 8 + n])
    off = 8 + n
    hi = np.frombuffer(zlib.decompress(blob[off: off + header["hi_bytes"]]), dtype=np.uint8)
    lo = np.frombuffer(blob[off + header["hi_bytes"]: off + header["hi_bytes"] + header["lo_bytes"]], dtype=np.uint8)
    flat = torch.from_numpy(np.stack([lo, hi], axis=1).reshape(-1).copy()).view(torch.bfloat16)
    tensors, k = {}, 0
    for name, shape in header["tensors"]:
        size = int(np.prod(shape)) if shape else 1
        tensors[name] = flat[k: k + size].view(shape).clone()
        k += size
    return tensors, header


def write_model(out: Path, model, mtp, proc, record: dict) -> None:
    """The model directory: BF16 weights in shards under 16 MB, mtp.*, processor files,
    training.json and a model card."""
    from ocriaquant.model.mtp import save_mtp

    out.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).to(torch.bfloat16)
    m.save_pretrained(out, max_shard_size="12MB")
    if mtp is not None:
        save_mtp(out, mtp, torch.bfloat16)
    save_processor(proc, out)
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "README.md").write_text(model_card(record))


def model_card(r: dict) -> str:
    shape, params = r["shape"], r["parameters"]
    lines = [
        "# ocria-reader (document reader, issue #57)", "",
        f"A {params['total'] / 1e6:.1f} M-parameter `Qwen3_5ForConditionalGeneration` with Qwen3.5's block structure "
        f"and its MTP layer ({params['total'] * 2 / 1e6:.1f} MB in BF16).", "",
        "| part | config |", "| --- | --- |",
        f"| text | hidden {shape['hidden']}, intermediate {shape['intermediate']}, {shape['layers']} layers "
        f"(GDN:attention 3:1), gated attention {shape['attn_heads']}q·{shape['kv_heads']}kv·{shape['head_dim']}, "
        f"GDN {shape['gdn_k_heads']}k·{shape['gdn_v_heads']}v heads of {shape['gdn_head_dim']}, tied embeddings; "
        f"{params['text'] / 1e6:.2f} M |",
        f"| vision | depth {shape['vision_depth']}, hidden {shape['vision_hidden']}, MLP {shape['vision_intermediate']}, "
        f"{shape['vision_heads']} heads, patch 16, 2×2 merge; pages up to {READER_MAX_PIXELS:,} px (768×1024) go in "
        "unresized; "
        f"{params['vision'] / 1e6:.2f} M |",
        f"| mtp | {shape['mtp_layers']} layer (`mtp.*`, as vLLM's qwen3_5_mtp loads it), trained with a next-next-token "
        f"loss (weight {r['args']['mtp_weight']}); {params['mtp'] / 1e6:.2f} M |",
        f"| tokenizer | Qwen3.5's tokenizer class, byte-level BPE of {r['vocab']} tokens learned from the generator's "
        f"markdown ({r['chars_per_token']:.2f} characters a token) |", "",
        "## Data", "",
        f"Document pages from `ocriaquant.data.docgen` drawn on the fly (seeds ≥ 10⁶, stream {r['args']['seed']}): "
        f"sizes {', '.join(f'{w}×{h}' for w, h in r['sizes'])} (weights {r['size_weights']}), body text "
        f"{r['font_px'][0]}–{r['font_px'][1]} px in DejaVu Sans / Serif, STIX and DejaVu Sans Mono, bold and italic, "
        "headings, lists, ruled and boxed tables, numbers and dates, SCOWL's English words, paper tint and scan "
        f"noise. {r['pages_rendered']:,} pages rendered, {r['pages_seen']:,} page-samples trained on "
        f"({r['pages_dropped']:,} dropped as longer than the text length {r['text_len']} tokens).", "",
        "## Training", "",
        f"{r['steps']:,} steps, **{r['wall_min']:.1f} GPU-minutes** in all ({r['train_min']:.1f} of them in "
        f"steps) over {len(r['runs'])} run(s) on {r['device']}; AdamW (β 0.9/0.98, wd 0.01), peak LR "
        f"{r['args']['lr']}, warm-up {r['args']['warmup']} steps, cosine to 5 % over the budget, BF16 autocast, clip 1.0; "
        f"the step as {'one CUDA graph per page size' if r['graphs'] else 'eager ops'}; GDN chunk: {r['gdn']}.", "",
        "| run | command |", "| --- | --- |",
    ]
    lines += [f"| {i + 1} | `{c}` |" for i, c in enumerate(r["runs"])]
    lines += ["", "## Figures (BF16, greedy)", "", "| step | GPU min | loss | MTP acc | own held-out NED [95% CI] | "
              "second renderer NED [95% CI] |", "| ---: | ---: | ---: | ---: | --- | --- |"]
    for e in r["evals"]:
        own, judge = e.get("own"), e.get("judge")
        cell = (lambda x: f"{x['ned']:.4f} [{x['ned_low']:.4f}, {x['ned_high']:.4f}]" if x else "—")
        lines.append(f"| {e['step']:,} | {e['wall_min']:.1f} | {e.get('loss', float('nan')):.4f} | "
                     f"{e.get('mtp_acc', float('nan')):.3f} | {cell(own)} | {cell(judge)} |")
    last = r["evals"][-1] if r["evals"] else {}
    for key, label in (("own", "own held-out"), ("judge", "second renderer")):
        if last.get(key):
            worst = ", ".join(f"{n} ({v})" for n, v in last[key]["worst"])
            lines.append(f"\nWorst {label} pages at the end: {worst}.")
    lines += ["", "Figures from `scripts/train_reference.py`'s in-training evaluation (transformers `generate`); "
              "`ocriaquant eval` gives the acceptance figures.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def lr_at(step: int, progress: float, peak: float, warmup: int, warm_from: int = 0) -> float:
    """Linear warm-up (from step `warm_from`: a resumed run with a fresh optimizer warms up again),
    then cosine to 5% of peak over `progress` in [0, 1]."""
    if step - warm_from < warmup:
        return peak * (step - warm_from + 1) / warmup
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def parse_sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for s in text.split(","):
        w, h = s.lower().split("x")
        out.append((int(w), int(h)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, help="tokenizer, state.pt, pack/ and log.jsonl live here")
    ap.add_argument("--out", type=Path, default=None, help="write the final BF16 model directory here")
    ap.add_argument("--unpack", type=Path, default=None, help="write --out from this pack and stop (no training)")
    ap.add_argument("--resume", action="store_true", help="continue from --work/state.pt (same machine)")
    ap.add_argument("--resume-from", type=Path, default=None,
                    help="continue from a pack (another machine): BF16 weights, fresh optimizer, same schedule")
    ap.add_argument("--minutes", type=float, default=50.0, help="wall (GPU) minutes in all, across runs")
    ap.add_argument("--stop-after", type=float, default=None,
                    help="end this run (setup, final evaluation and saves included) within this many minutes")
    ap.add_argument("--steps", type=int, default=1_000_000, help="at most this many steps in all")
    ap.add_argument("--batch", type=int, default=48, help="pages a step at the smallest size (others by area)")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--rewarm", type=int, default=100, help="warm-up steps after --resume-from (fresh optimizer)")
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP next-next-token loss (0: no MTP)")
    ap.add_argument("--sizes", default="512x640,640x832,768x1024", help="page sizes WxH")
    ap.add_argument("--size-weights", default="0.55,0.3,0.15", help="share of training pages per size")
    ap.add_argument("--font-px", default="13-24", help="body text size range LO-HI px")
    ap.add_argument("--max-chars", type=int, default=2000, help="the generator starts no block past this")
    ap.add_argument("--text-len", type=int, default=0,
                    help="target tokens per page size (0: the pool's 99.5th percentile, to a multiple of 64)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokenizer-pages", type=int, default=4000, help="pages whose markdown trains the tokenizer")
    ap.add_argument("--pool", type=int, default=6000, help="pages kept on the device, over all sizes")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--refresh", type=int, default=24,
                    help="at most this many new pages enter the pool a step (the main process copies them in)")
    ap.add_argument("--gdn", default="auto", choices=["auto", "fla", "fla-bk32", "fla-fwd", "torch"])
    ap.add_argument("--no-graph", action="store_true", help="run the step eagerly")
    ap.add_argument("--eval-every", type=float, default=10.0, help="minutes between evaluations (0: at the end only)")
    ap.add_argument("--eval-pages", type=int, default=64, help="own held-out pages (seeds 0..N-1)")
    ap.add_argument("--judge", type=Path, default=None, help="second-renderer pages (PNG + .md) decoded at each eval")
    ap.add_argument("--eval-batch", type=int, default=64, help="pages a generate call decodes together")
    ap.add_argument("--save-every", type=int, default=1000, help="steps between state.pt + pack saves")
    ap.add_argument("--save-minutes", type=float, default=3.0,
                    help="and at least this often: a lent machine lost between saves loses no more")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a tiny reader (CPU smoke tests)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    if args.unpack:
        if not args.out:
            raise SystemExit("--unpack needs --out")
        return unpack(args.unpack, args.out)
    if not args.work:
        raise SystemExit("--work is required")
    t_start = time.time()
    from transformers import Qwen3_5ForConditionalGeneration

    from ocriaquant.model import gdn_train
    from ocriaquant.model.mtp import Qwen35MTP

    dev = torch.device(args.device)
    args.work.mkdir(parents=True, exist_ok=True)
    log_path = args.work / "log.jsonl"

    def log(rec: dict) -> None:
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)

    state_path = args.work / "state.pt"
    state = None
    pack_tensors, pack_meta = None, None
    if args.resume and state_path.exists():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        prev = state["meta"]
    elif args.resume_from:
        pack_tensors, pack_meta = load_pack(args.resume_from)
        prev = pack_meta
    else:
        prev = None
    if prev:  # the data, the shape and the schedule are the first run's
        for k in ("sizes", "size_weights", "font_px", "max_chars", "vocab", "seed", "tiny", "mtp_weight", "batch"):
            setattr(args, k, prev["args"][k])
    sizes = parse_sizes(args.sizes)
    weights = [float(w) for w in args.size_weights.split(",")][: len(sizes)]
    weights += [weights[-1]] * (len(sizes) - len(weights))
    lo_px, hi_px = (int(v) for v in args.font_px.split("-"))
    styles = [replace(DOC_STYLE, sizes=(s,), size_weights=None, font_px=(lo_px, hi_px), max_chars=args.max_chars)
              for s in sizes]
    stream = PageStream(args.seed, styles, weights)
    shape = TINY if args.tiny else ReaderShape(vocab=args.vocab)

    ex = ProcessPoolExecutor(args.workers)
    list(ex.map(abs, range(4 * args.workers)))  # fork the workers now, before CUDA starts in this process
    area0 = min(w * h for w, h in sizes)
    batches = [max(1, round(args.batch * area0 / (w * h))) for w, h in sizes]
    pool_sizes = [max(b * 4, int(args.pool * w / sum(weights))) for b, w in zip(batches, weights)]
    next_index = (state or {}).get("next_index", (prev or {}).get("next_index", 0))
    pool = PagePool(stream, sizes, pool_sizes, ex, dev, next_index, in_flight=max(64, 8 * args.workers))

    # First pages: the tokenizer's corpus on a first run, then the pool.
    t0 = time.time()
    tok_dir = args.work / "tokenizer"
    first: list = []
    if prev is None and not (tok_dir / "tokenizer.json").exists():
        need = min(args.tokenizer_pages, sum(pool_sizes))
        while len(first) < need:
            pool.submit()
            first += pool.collect(block=True, limit=need - len(first))
        tok = train_reader_tokenizer([md for *_, md in first], shape.vocab)
        tok.save_pretrained(tok_dir)
    else:
        if prev is not None and not (tok_dir / "tokenizer.json").exists():
            tok_dir.mkdir(parents=True, exist_ok=True)
            for name, text in prev["tokenizer_files"].items():
                (tok_dir / name).write_text(text)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_dir)
        from ocriaquant.model.processor import CHAT_TEMPLATE

        tok.chat_template = tok.chat_template or CHAT_TEMPLATE
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    proc = reader_processor(tok)
    chars_per_token = (sum(len(md) for *_, md in first) / max(1, sum(len(tok(md)["input_ids"]) for *_, md in first))
                       if first else (prev or {}).get("chars_per_token", float("nan")))
    if prev is not None:
        text_len = prev["text_len"]
    elif args.text_len:
        text_len = [args.text_len] * len(sizes)
    else:  # from the first pages of each size
        sample = first if first else []
        while min([sum(1 for b, *_ in sample if b == k) for k in range(len(sizes))]) < 40:
            pool.submit()
            sample += pool.collect(block=True, limit=64)
        text_len = []
        for k in range(len(sizes)):
            lens = [len(tok(md)["input_ids"]) + 1 for b, _, _, md in sample if b == k]
            text_len.append(int(math.ceil(np.percentile(lens, 99.5) / 64) * 64))
        first = sample
    pool.set_tokenizer(tok, end_id, text_len)
    for k in range(0, len(first), 256):
        pool.insert(first[k: k + 256])
    while not pool.full():
        pool.submit()
        pool.insert(pool.collect(block=True, limit=256))
    setup_pool_s = time.time() - t0

    # Model, MTP, optimizer.
    torch.manual_seed(args.seed)
    cfg = reader_config(tok, shape)
    model = Qwen3_5ForConditionalGeneration(cfg).to(dev).float()
    mtp = Qwen35MTP(model.config.text_config).to(dev).float() if args.mtp_weight > 0 else None
    params = list(model.parameters()) + (list(mtp.parameters()) if mtp else [])
    lr_t = torch.tensor(args.lr, device=dev)
    cuda = dev.type == "cuda"
    opt = torch.optim.AdamW(params, lr=lr_t if cuda else args.lr, betas=(0.9, 0.98), weight_decay=0.01,
                            capturable=cuda)
    step, trained_s, wall_prev, warm_from = 0, 0.0, 0.0, 0
    evals, runs, seen = [], [], 0
    if state is not None:
        model.load_state_dict(state["model"])
        if mtp is not None:
            mtp.load_state_dict(state["mtp"])
        opt.load_state_dict(state["opt"])
        if cuda:
            for g in opt.param_groups:  # the loaded groups carry a copy of the lr tensor: point them at ours
                g["lr"] = lr_t
        step, trained_s, wall_prev = state["step"], state["trained_s"], state["wall_s"]
        evals, runs, seen, warm_from = prev["evals"], prev["runs"], prev["pages_seen"], prev.get("warm_from", 0)
    elif pack_tensors is not None:
        model.load_state_dict({k: v.float() for k, v in pack_tensors.items() if not k.startswith("mtp.")})
        if mtp is not None:
            mtp.load_state_dict({k[4:]: v.float() for k, v in pack_tensors.items() if k.startswith("mtp.")})
        step, trained_s, wall_prev = prev["steps"], prev["trained_s"], prev["wall_s"]
        evals, runs, seen = prev["evals"], prev["runs"], prev["pages_seen"]
        warm_from = step  # a fresh optimizer: warm up again
    runs.append(" ".join(sys.argv[1:]))
    prev_rendered = (prev or {}).get("pages_rendered", 0)
    counts = count_parameters(model.config)
    log({"event": "start", "step": step, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
         "params": counts, "sizes": sizes, "batches": batches, "pool": pool_sizes, "text_len": text_len,
         "vocab": len(tok), "chars_per_token": round(chars_per_token, 3), "setup_pool_s": round(setup_pool_s, 1),
         "resumed": bool(prev)})

    gdn_name, gdn_report = ("torch", {}) if args.gdn == "torch" else (args.gdn, {})
    log_device = torch.cuda.get_device_name(dev) if cuda else "cpu"
    if args.gdn == "auto" and prev and prev.get("gdn") and prev.get("device") == log_device:
        gdn_name, gdn_report = prev["gdn"], {"reused": f"chosen by an earlier run on a {log_device}"}  # its checks ran
    elif args.gdn == "auto":
        gdn_name, gdn_report = gdn_train.select(shape.gdn_v_heads, shape.gdn_head_dim, dev)
    gdn_train.install(gdn_name)
    log({"event": "gdn", "chosen": gdn_name, "report": gdn_report})

    model.train()
    fwds = [PageBatchForward(model, proc, (h, w), t, DEFAULT_PROMPT).to(dev) for (w, h), t in zip(sizes, text_len)]
    s_imgs = [torch.zeros(b, 3, h, w, dtype=torch.uint8, device=dev) for b, (w, h) in zip(batches, sizes)]
    s_ids = [torch.zeros(b, t, dtype=torch.long, device=dev) for b, t in zip(batches, text_len)]
    s_mask = [torch.zeros(b, t, dtype=torch.bool, device=dev) for b, t in zip(batches, text_len)]
    gen = torch.Generator(device=dev).manual_seed(args.seed * 1000 + step)
    # Steps by page size: a step of size k trains batches[k] pages; steps are drawn so that pages
    # follow the size weights.
    step_w = [w / b for w, b in zip(weights, batches)]
    step_cum = list(np.cumsum([w / sum(step_w) for w in step_w]))

    def bucket_at(i: int) -> int:
        return min(bisect.bisect_right(step_cum, (i * 0.7548776662466927) % 1.0), len(sizes) - 1)

    def fill(k: int) -> None:
        idx = torch.randint(0, pool.filled[k], (batches[k],), device=dev, generator=gen)
        s_imgs[k].copy_(pool.images[k][idx])
        s_ids[k].copy_(pool.ids[k][idx])
        s_mask[k].copy_(pool.mask[k][idx])

    def train_step(k: int) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss, parts = step_loss(fwds[k], model, mtp, s_imgs[k], s_ids[k], s_mask[k], args.mtp_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return parts

    def wall() -> float:
        return wall_prev + (time.time() - t_start)

    def progress() -> float:
        return max(step / args.steps, wall() / (args.minutes * 60))

    def set_lr() -> float:
        lr = lr_at(step, progress(), args.lr, args.warmup if warm_from == 0 else args.rewarm, warm_from)
        if cuda:
            lr_t.fill_(lr)
        else:
            for g in opt.param_groups:
                g["lr"] = lr
        return lr

    graphs, outs = None, None
    if cuda and not args.no_graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (allocator, cuBLAS, Triton autotune): trains for real
            for k in range(len(sizes)):
                for _ in range(3):
                    set_lr()
                    fill(k)
                    train_step(k)
                    step += 1
                    seen += batches[k]
        torch.cuda.current_stream().wait_stream(side)
        try:
            mempool = torch.cuda.graph_pool_handle()
            graphs, outs = [], []
            for k in range(len(sizes)):
                fill(k)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=mempool):
                    outs.append(train_step(k))
                graphs.append(g)
        except Exception as e:  # keep training, eagerly, rather than lose the run
            log({"event": "graph_capture_failed", "error": f"{type(e).__name__}: {str(e)[:300]}"})
            graphs, outs = None, None
    log({"event": "ready", "step": step, "graphs": graphs is not None, "setup_s": round(time.time() - t_start, 1)})

    own_pages = held_out_pages(args.eval_pages, replace(DOC_STYLE, sizes=tuple(sizes), size_weights=tuple(weights),
                                                         font_px=(lo_px, hi_px), max_chars=args.max_chars), ex)
    judge_pages = load_pages(args.judge).pages if args.judge else []

    def record() -> dict:
        return {"args": vars(args) | {"work": str(args.work), "out": str(args.out), "judge": str(args.judge),
                                      "resume_from": str(args.resume_from), "unpack": None},
                "shape": asdict(shape), "parameters": counts, "vocab": len(tok), "chars_per_token": chars_per_token,
                "sizes": sizes, "size_weights": weights, "font_px": [lo_px, hi_px], "text_len": text_len,
                "steps": step, "trained_s": trained_s, "wall_s": wall(), "wall_min": wall() / 60,
                "train_min": trained_s / 60, "next_index": pool.next_index, "pages_seen": seen,
                "pages_rendered": pool.rendered + prev_rendered,
                "pages_dropped": pool.dropped + (prev or {}).get("pages_dropped", 0),
                "pages_failed": (prev or {}).get("pages_failed", []) + [list(f) for f in pool.failed][:20],
                "evals": evals, "runs": runs,
                "gdn": gdn_name, "graphs": graphs is not None, "warm_from": warm_from,
                "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
                "tokenizer_files": {p.name: p.read_text() for p in tok_dir.iterdir() if p.is_file()}}

    def save() -> None:
        nonlocal saved_at
        t = time.time()
        rec = record()
        tmp = state_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "mtp": mtp.state_dict() if mtp else None, "opt": opt.state_dict(),
                    "step": step, "trained_s": trained_s, "wall_s": wall(), "next_index": pool.next_index,
                    "meta": rec}, tmp)
        os.replace(tmp, state_path)
        tensors = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        if mtp is not None:
            tensors |= {f"mtp.{k}": v.detach().cpu() for k, v in mtp.state_dict().items()}
        save_pack(args.work / "pack", tensors, rec)
        log({"event": "saved", "step": step, "s": round(time.time() - t, 1)})
        saved_at = time.time()

    def run_eval(final: bool = False) -> None:
        t = time.time()
        e = {"step": step, "wall_min": round(wall() / 60, 2), "final": final}
        if recent:
            e["loss"] = round(float(torch.stack([r[0] for r in recent]).mean()), 4)
            e["mtp_acc"] = round(float(torch.stack([r[2] for r in recent]).mean()), 4)
        e["own"] = evaluate(model, proc, own_pages, args.eval_batch) if own_pages else None
        e["judge"] = evaluate(model, proc, judge_pages, args.eval_batch) if judge_pages else None
        e["eval_s"] = round(time.time() - t, 1)
        evals.append(e)
        log({"event": "eval", **e})
        model.train()

    saved_at = time.time()
    stop_s = args.stop_after * 60 if args.stop_after else float("inf")
    # Wall seconds kept for the final evaluation and saves (measured at the first evaluation).
    reserve = 90.0 if cuda and (own_pages or judge_pages) else 0.0
    next_eval = wall() + args.eval_every * 60 if args.eval_every else float("inf")
    recent: list[torch.Tensor] = []
    t_last, step_last, seen_last = time.time(), step, seen
    while step < args.steps and wall() + reserve < args.minutes * 60 and time.time() - t_start + reserve < stop_s:
        t_step = time.time()
        k = bucket_at(step)
        lr = set_lr()
        fill(k)
        if graphs is not None:
            graphs[k].replay()
            parts = outs[k]
        else:
            parts = train_step(k)
        recent.append(parts.clone())
        step += 1
        seen += batches[k]
        # New pages from the workers replace the oldest ones (after this step's batch was read).
        pool.insert(pool.collect(limit=args.refresh))
        pool.submit()
        trained_s += time.time() - t_step
        if step % args.log_every == 0:
            now = time.time()
            r = torch.stack(recent[-args.log_every:]).mean(0).tolist()
            rate = (step - step_last) / (now - t_last)
            log({"step": step, "ce": round(r[0], 4), "mtp_ce": round(r[1], 4), "mtp_acc": round(r[2], 4),
                 "lr": round(lr, 7), "steps_per_s": round(rate, 2),
                 "pages_per_s": round((seen - seen_last) / (now - t_last), 1),
                 "rendered": pool.rendered + prev_rendered,
                 "fresh": round((pool.rendered + prev_rendered) / max(1, seen), 3),
                 "wall_min": round(wall() / 60, 2)} | ({"render_failed": len(pool.failed)} if pool.failed else {}))
            t_last, step_last, seen_last = now, step, seen
            recent = recent[-args.log_every:]
        if step % args.save_every == 0 or time.time() - saved_at >= args.save_minutes * 60:
            save()
        if wall() >= next_eval:
            next_eval += args.eval_every * 60
            t_e = time.time()
            run_eval()
            reserve = (time.time() - t_e) * 1.2 + 20
            t_last = time.time()
    if cuda:
        torch.cuda.synchronize()
    run_eval(final=True)
    save()
    if args.out:
        write_model(args.out, model, mtp, proc, record())
        log({"event": "wrote", "out": str(args.out)})
    for f in pool.futures:
        f.cancel()
    ex.shutdown(wait=False, cancel_futures=True)


def unpack(pack_dir: Path, out: Path) -> None:
    """The model directory from a pack (CPU): weights as trained, in BF16."""
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    from ocriaquant.model.mtp import Qwen35MTP
    from ocriaquant.model.processor import CHAT_TEMPLATE

    tensors, meta = load_pack(pack_dir)
    tmp = out.with_name(out.name + ".tok")
    tmp.mkdir(parents=True, exist_ok=True)
    for name, text in meta["tokenizer_files"].items():
        (tmp / name).write_text(text)
    tok = AutoTokenizer.from_pretrained(tmp)
    tok.chat_template = tok.chat_template or CHAT_TEMPLATE
    shutil.rmtree(tmp)
    shape = ReaderShape(**meta["shape"])
    model = Qwen3_5ForConditionalGeneration(reader_config(tok, shape))
    model.load_state_dict({k: v.float() for k, v in tensors.items() if not k.startswith("mtp.")})
    mtp = None
    if any(k.startswith("mtp.") for k in tensors):
        mtp = Qwen35MTP(model.config.text_config)
        mtp.load_state_dict({k[4:]: v.float() for k, v in tensors.items() if k.startswith("mtp.")})
    write_model(out, model, mtp, reader_processor(tok), meta)
    print(f"wrote {out} (step {meta['steps']}, {meta['wall_min']:.1f} GPU-minutes)")


if __name__ == "__main__":
    main()
