"""Train the bundled reference model (ocria-nano) to read synthetic grid pages.

    python scripts/train_reference.py --work /tmp/train --minutes 9     # on a GPU
    python scripts/train_reference.py --work /tmp/train --minutes 9 --resume

Why it is fast: every page has one size (512x512) and one prompt and every target is padded
to one length, so positions, vision rotary and position-embedding interpolation are
computed once (ocriaquant.model.batched), the vision attention is batched across pages, the
page pool lives on the GPU as uint8, and the whole step (forward, backward, AdamW) is
captured in one CUDA graph: the stock transformers forward is launch-bound (~9,000 launches
a step, DESIGN.md), a replayed graph is not.

Seeded and resumable: `--work` holds the page pool, `state.pt` (weights, optimizer, step,
RNG) written atomically every `--save-every` steps and at the end, and `log.jsonl`. A run
stops cleanly after `--minutes` and a later `--resume` continues from the last state.
Training pages come from seeds >= 10**6; the bundled held-out pages (calib_data/, seeds
0..127, held-out by name hash) are never trained on, and are what `--eval-every` decodes.

The bundled model's own training logs (its `log.jsonl` over all runs, and the printed output of its
last run) are kept in benchmarks/results/train_reference_ocria-nano*.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ocriaquant.data import BUNDLED_PAGES, DEFAULT_PROMPT, load_pages, split_pages
from ocriaquant.data.synth import GRID_STYLE, make_page
from ocriaquant.model.batched import PageBatchForward
from ocriaquant.model.processor import chat_text, save_processor
from ocriaquant.model.reference import reference_config, reference_processor

TRAIN_SEED_BASE = 10**6
TEXT_LEN = 320  # longest grid-page markdown is < 300 bytes; +1 for <|im_end|>


def _render(seed: int) -> tuple[np.ndarray, str]:
    page = make_page(seed, GRID_STYLE)
    return np.asarray(page.image.convert("L"), dtype=np.uint8), page.markdown


def build_pool(n: int, seed: int, workers: int) -> tuple[np.ndarray, list[str]]:
    """Render the training pages (seeded: the same n and seed give the same pool)."""
    seeds = [TRAIN_SEED_BASE + seed * 10**7 + i for i in range(n)]
    with ProcessPoolExecutor(workers) as ex:
        out = list(ex.map(_render, seeds, chunksize=256))
    return np.stack([o[0] for o in out]), [o[1] for o in out]


def encode_targets(tok, texts: list[str], end_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(texts), TEXT_LEN, dtype=torch.long)
    mask = torch.zeros(len(texts), TEXT_LEN, dtype=torch.bool)
    for i, t in enumerate(texts):
        seq = tok(t)["input_ids"][: TEXT_LEN - 1] + [end_id]
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = True
    return ids, mask


@torch.no_grad()
def evaluate(model, proc, pages, device) -> dict:
    """Greedy-decode pages in BF16 through transformers' own generate; NED vs ground truth."""
    import copy

    from ocriaquant.eval import bootstrap_mean, ned

    m = copy.deepcopy(model).to(torch.bfloat16).eval()
    prompt = chat_text(proc, DEFAULT_PROMPT)
    preds = []
    for i in range(0, len(pages), 64):
        chunk = pages[i: i + 64]
        enc = proc(images=[p.image for p in chunk], text=[prompt] * len(chunk), return_tensors="pt").to(device)
        out = m.generate(**enc, max_new_tokens=TEXT_LEN, do_sample=False)
        preds += proc.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    scores = [ned(p.strip(), pg.reference) for p, pg in zip(preds, pages)]
    ci = bootstrap_mean(scores)
    worst = int(np.argmax(scores))
    del m
    return {"ned": ci.estimate, "ned_low": ci.low, "ned_high": ci.high, "worst": pages[worst].name,
            "worst_ned": scores[worst], "sample": preds[0][:200]}


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine to 5% of peak over `progress` in [0, 1]."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="pool, state.pt and log.jsonl live here")
    ap.add_argument("--out", type=Path, default=None, help="write the final BF16 model + processor here")
    ap.add_argument("--steps", type=int, default=100_000, help="at most this many steps in all")
    ap.add_argument("--minutes", type=float, default=16.0,
                    help="training time in all, across resumed runs; the LR schedule and curriculum follow "
                         "whichever of steps and minutes is further along")
    ap.add_argument("--stop-after", type=float, default=None,
                    help="stop this run (saving state) after this many minutes, to resume later")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--pool", type=int, default=40000, help="training pages rendered once, kept on the GPU")
    ap.add_argument("--curriculum", type=float, default=0.25,
                    help="fraction of steps over which the pool widens from the shortest 25%% of pages to all")
    ap.add_argument("--eval-every", type=float, default=4.0, help="minutes of training between evaluations")
    ap.add_argument("--eval-pages", type=int, default=0, help="decode only the first N held-out pages (0: all)")
    ap.add_argument("--save-every", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--resume", action="store_true", help="continue from --work/state.pt (weights, optimizer, step)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from these weights (e.g. the bundled model) with a fresh optimizer; "
                         "--minutes then counts this run only")
    ap.add_argument("--no-graph", action="store_true", help="run eagerly (debugging, CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    args.work.mkdir(parents=True, exist_ok=True)
    log_path = args.work / "log.jsonl"
    proc = reference_processor()
    tok = proc.tokenizer
    end_id = tok.convert_tokens_to_ids("<|im_end|>")

    t0 = time.time()
    images, texts = build_pool(args.pool, args.seed, args.workers)
    ids_all, mask_all = encode_targets(tok, texts, end_id)
    lengths = mask_all.sum(1)
    order = torch.argsort(lengths).to(dev)  # curriculum: shortest pages first
    pool = torch.from_numpy(images).to(dev)  # [N, H, W] uint8
    ids_all, mask_all = ids_all.to(dev), mask_all.to(dev)
    print(f"pool: {len(texts)} pages in {time.time() - t0:.0f}s, target length p50 {int(lengths.median())} "
          f"max {int(lengths.max())}", flush=True)

    _, heldout = split_pages(load_pages(BUNDLED_PAGES).pages)
    if args.eval_pages:
        heldout = heldout[: args.eval_pages]

    model = Qwen3_5ForConditionalGeneration(reference_config()).to(dev).float()
    lr_t = torch.tensor(args.lr, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=lr_t if dev.type == "cuda" else args.lr, betas=(0.9, 0.98),
                            weight_decay=0.01, capturable=dev.type == "cuda")
    step, trained_s = 0, 0.0
    state_path = args.work / "state.pt"
    if args.init_from is not None and not (args.resume and state_path.exists()):
        src = Qwen3_5ForConditionalGeneration.from_pretrained(args.init_from, dtype=torch.float32)
        model.load_state_dict(src.state_dict())
        del src
        print(f"initialized from {args.init_from}", flush=True)
    if args.resume and state_path.exists():
        st = torch.load(state_path, map_location=dev, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, trained_s = st["step"], st["trained_s"]
        torch.set_rng_state(st["rng"].cpu())
        print(f"resumed at step {step}", flush=True)
    model.train()
    fwd = PageBatchForward(model, proc, (GRID_STYLE.height, GRID_STYLE.width), TEXT_LEN, DEFAULT_PROMPT).to(dev)

    b = args.batch
    s_imgs = torch.zeros(b, 3, GRID_STYLE.height, GRID_STYLE.width, dtype=torch.uint8, device=dev)
    s_ids = torch.zeros(b, TEXT_LEN, dtype=torch.long, device=dev)
    s_mask = torch.zeros(b, TEXT_LEN, dtype=torch.bool, device=dev)
    gen = torch.Generator(device=dev).manual_seed(args.seed * 1000 + step)

    def progress() -> float:
        return max(step / args.steps, trained_s / (args.minutes * 60))

    def fill(step_i: int) -> None:
        frac = min(1.0, 0.25 + 0.75 * progress() / args.curriculum)
        n_allowed = max(b, int(frac * len(order)))
        pick = order[torch.randint(0, n_allowed, (b,), device=dev, generator=gen)]
        s_imgs.copy_(pool[pick].unsqueeze(1).expand(-1, 3, -1, -1))
        s_ids.copy_(ids_all[pick])
        s_mask.copy_(mask_all[pick])

    def train_step() -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = fwd(s_imgs, s_ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), s_ids.flatten(), reduction="none")
        loss = (loss * s_mask.flatten()).sum() / s_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    graph = None
    fill(step)
    if dev.type == "cuda" and not args.no_graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # Warm-up on a side stream (allocator + cuBLAS workspaces), as CUDA-graph capture requires.
        # These steps train for real: keep their count in `step`.
        with torch.cuda.stream(side):
            for _ in range(3):
                lr_t.fill_(lr_at(step, progress(), args.lr, args.warmup))
                train_step()
                step += 1
                fill(step)
        torch.cuda.current_stream().wait_stream(side)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                s_loss = train_step()
        except RuntimeError as e:  # keep training, eagerly, rather than lose the run
            print(f"CUDA graph capture failed, running eagerly: {e}", flush=True)
            graph = None

    def save_state() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "trained_s": trained_s,
                    "rng": torch.get_rng_state()}, tmp)
        os.replace(tmp, state_path)

    def log(rec: dict) -> None:
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)

    run_start = time.time()
    t_last, step_last, losses = time.time(), step, []
    next_eval = trained_s + args.eval_every * 60
    stop_s = args.stop_after * 60 if args.stop_after else float("inf")
    while step < args.steps and trained_s < args.minutes * 60 and time.time() - run_start < stop_s:
        t_step = time.time()
        lr = lr_at(step, progress(), args.lr, args.warmup)
        if dev.type == "cuda":
            lr_t.fill_(lr)
        else:
            for g in opt.param_groups:
                g["lr"] = lr
        if graph is not None:
            graph.replay()
            loss = s_loss
        else:
            loss = train_step()
        step += 1
        fill(step)
        losses.append(loss.clone())
        trained_s += time.time() - t_step
        if step % 100 == 0:
            now = time.time()
            rate = (step - step_last) / (now - t_last)
            log({"step": step, "loss": round(float(torch.stack(losses).mean()), 4), "lr": lr,
                 "steps_per_s": round(rate, 2), "pages_per_s": round(rate * b, 1),
                 "train_min": round(trained_s / 60, 2)})
            losses, t_last, step_last = [], now, step
        if step % args.save_every == 0:
            save_state()
        if args.eval_every and trained_s >= next_eval:
            next_eval += args.eval_every * 60
            t_eval = time.time()
            res = evaluate(model, proc, heldout, dev)
            log({"step": step, "train_min": round(trained_s / 60, 2), "eval": res,
                 "eval_s": round(time.time() - t_eval, 1)})
            t_last = time.time()
    save_state()
    log({"step": step, "train_min": round(trained_s / 60, 2), "final": True,
         "eval": evaluate(model, proc, heldout, dev)})
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        # Shards under 16 MB each (what the GPU machine can hand back per file).
        model.to(torch.bfloat16).save_pretrained(args.out, max_shard_size="12MB")
        save_processor(proc, args.out)
        print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
