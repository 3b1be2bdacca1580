"""Issue #56's 4B acceptance, end to end on one GPU: calibrate → search → export on a
Qwen3.5-4B-shaped model with random weights, timed, with the peak GPU memory.

    python benchmarks/search_4b.py --json benchmarks/results/search_4b_<card>_<date>.json

Setup (reported apart, reused by a rerun with the same settings): the shape built with random
BF16 weights and the byte tokenizer, saved as a model directory; synthetic pages of
`--megapixels` rendered until there are `--calib-pages` calibration and `--eval-pages` held-out
pages (the hash split decides which is which). Then the pipeline, timed stage by stage:

- calibrate on the calibration pages (bf16 on the GPU);
- search, target h200, priced with ocriaquant/recipes/latency_h200.json: BF16, all-FP8, all-NVFP4 and
  `--candidates` frontier points (the finalists), the b200 W4A4 decode (and with `--peers all`
  the published recipes), each built in our runtime (triton backend, CUDA graphs) and decoded on
  every held-out page × up to `--max-new-tokens` tokens (random weights rarely emit EOS: expect the
  full length), each timed at batch 1 and at `--batch`;
- export the chosen plan (its reload check is skipped: it decodes with transformers on the CPU).

The acceptance: the three stages within 10 minutes, at least 6 finalists decoded and timed, and
for every finalist the measured beside the predicted step with their Spearman rank correlation
(report.md in WORK/search). On the CPU a toy run checks the script, not the figures:

    python benchmarks/search_4b.py --shape tiny --device cpu --megapixels 0.08 --calib-pages 2 \\
        --eval-pages 3 --max-new-tokens 8 --candidates 1 --batch 2 --work /tmp/search_4b_toy
"""

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
from rich.console import Console

from ocriaquant.calibrate import CalibrateOptions, calibrate
from ocriaquant.data.split import is_heldout
from ocriaquant.data.synth import SynthStyle, make_page
from ocriaquant.export import export
from ocriaquant.model import tiny_config
from ocriaquant.model.configs import SHAPES, use_tokenizer_ids
from ocriaquant.model.processor import PageProcessor, build_byte_tokenizer, build_image_processor, save_processor
from ocriaquant.recipes import RECIPES
from ocriaquant.search import SearchOptions, run_search

LIMIT_S = 600  # the acceptance: calibrate + search + export


def build_model(shape: str, side: int, out: Path, device: str) -> None:
    from transformers import Qwen3_5ForConditionalGeneration

    tok = build_byte_tokenizer()
    config = tiny_config() if shape == "tiny" else use_tokenizer_ids(SHAPES[shape](), tok)
    with torch.device(device):
        torch.manual_seed(0)
        model = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    save_processor(PageProcessor(image_processor=build_image_processor(max_pixels=side * side + 1), tokenizer=tok,
                                 video_processor=None, chat_template=tok.chat_template), out)


def write_split_pages(out: Path, side: int, calib: int, held: int, seed: int = 7) -> tuple[int, int]:
    """Render pages named as write_pages names them until the hash split gives `calib`
    calibration and `held` held-out pages; only those are written."""
    out.mkdir(parents=True, exist_ok=True)
    font = max(12, side // 52)
    style = SynthStyle(width=side, height=side, font_size=font, heading_size=font * 7 // 5,
                       subheading_size=font * 6 // 5, margin=max(16, side // 32))
    n_cal = n_held = 0
    i = 0
    while n_cal < calib or n_held < held:
        name = f"page-{i:04d}"
        side_held = is_heldout(name + ".png")
        if (side_held and n_held < held) or (not side_held and n_cal < calib):
            page = make_page(seed * 1_000_003 + i, style)
            page.image.save(out / f"{name}.png")
            (out / f"{name}.md").write_text(page.markdown + "\n", encoding="utf-8")
            n_held, n_cal = n_held + side_held, n_cal + (not side_held)
        i += 1
    return n_cal, n_held


def sig(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.4g}")


def peak_gb(cuda: bool) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 1e9, 1) if cuda else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3.5-4b", choices=sorted(SHAPES) + ["tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--megapixels", type=float, default=4.1)
    ap.add_argument("--calib-pages", type=int, default=8)
    ap.add_argument("--eval-pages", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=1000)
    ap.add_argument("--candidates", type=int, default=4, help="frontier points besides BF16 / FP8 / NVFP4")
    ap.add_argument("--peers", default="none", help="published recipes judged beside ours: none (default: the "
                    "acceptance is about our finalists), all (four more models decoded and timed) or NAME,NAME")
    ap.add_argument("--batch", type=int, default=64, help="the served batch the step is also timed at")
    ap.add_argument("--objective", default="latency", choices=["latency", "throughput"])
    ap.add_argument("--slo-p90", type=float, default=None)
    ap.add_argument("--latency-table", type=Path, default=RECIPES / "latency_h200.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/search_4b"))
    ap.add_argument("--fresh", action="store_true", help="rebuild the model and pages even where they are there")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; a toy run on the CPU: see --help")
    side = int(math.sqrt(args.megapixels * 1e6) // 32 * 32)
    model_dir, pages_dir, done = args.work / "model", args.work / "pages", args.work / "setup.json"
    setup = {"shape": args.shape, "side": side, "calib_pages": args.calib_pages, "eval_pages": args.eval_pages}

    t = time.time()
    if args.fresh or not done.exists() or json.loads(done.read_text()) != setup:
        shutil.rmtree(args.work, ignore_errors=True)
        build_model(args.shape, side, model_dir, args.device)
        write_split_pages(pages_dir, side, args.calib_pages, args.eval_pages)
        done.write_text(json.dumps(setup))
    setup_s = time.time() - t
    for d in ("calib", "search", "checkpoint"):
        shutil.rmtree(args.work / d, ignore_errors=True)

    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    stages, peaks = {}, {}
    t0 = t = time.time()
    calibrate(model_dir, pages_dir, args.work / "calib", CalibrateOptions(
        max_pages=args.calib_pages, batch_size=1, device=args.device, dtype="bf16" if cuda else "fp32",
        split="calibration"))
    stages["calibrate_s"], peaks["calibrate_gb"] = round(time.time() - t, 1), peak_gb(cuda)
    print(f"setup {setup_s:.1f} s; calibrate {stages['calibrate_s']} s, peak GPU {peaks['calibrate_gb']} GB", flush=True)
    t = time.time()
    opts = SearchOptions(target="h200", batch=args.batch, latency_table=args.latency_table,
                         eval_pages=args.eval_pages, candidates=args.candidates, device=args.device, dtype="bf16",
                         batch_size=64, max_new_tokens=args.max_new_tokens, peers=args.peers,
                         objective=args.objective, slo_p90=args.slo_p90, measure=True)
    # progress drawn even into a log file: a failed run's log names the candidate it was decoding
    rep = run_search(args.work / "calib", pages_dir, args.work / "search", opts,
                     console=Console(stderr=True, force_terminal=True, width=150))
    if cuda:
        torch.cuda.synchronize()
    stages["search_s"], peaks["search_gb"] = round(time.time() - t, 1), peak_gb(cuda)
    print(f"search {stages['search_s']} s, peak GPU {peaks['search_gb']} GB", flush=True)  # kept if export fails
    t = time.time()
    exported = rep["chosen"] != "BF16"
    if exported:
        export(args.work / "search" / "plan.json", args.work / "checkpoint", pages=pages_dir,
               max_pages=args.calib_pages, verify_pages=0, force=True)
    stages["export_s"], peaks["export_gb"] = round(time.time() - t, 1) if exported else None, peak_gb(cuda)
    pipeline_s = round(time.time() - t0, 1)

    # finalists: our candidates in the target's numerics, each a model of its own, decoded and timed
    finalists = [c for c in rep["candidates"] if c["role"] != "peer" and c["measured"] and not c["decoded_as"]]
    timed = [c for c in rep["candidates"] if c["measured"] and not c["decoded_as"]]
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "shape": args.shape, "page_px": [side, side], "calibration_pages": args.calib_pages,
           "heldout_pages": rep["eval_pages"], "max_new_tokens": args.max_new_tokens, "batch": args.batch,
           "objective": args.objective, "setup_s": round(setup_s, 1), **stages, "pipeline_s": pipeline_s,
           "within_10_min": pipeline_s <= LIMIT_S, "peak_gpu_gb": peak_gb(cuda), "peak_gpu_gb_by_stage": peaks,
           "chosen": rep["chosen"], "verdict": rep["verdict"], "finalists": len(finalists),
           "decoded_tokens": rep["decoding"]["tokens"], "decode_tok_per_s": rep["decoding"]["tok_per_s"],
           "decode_wall_s": rep["decoding"]["wall_s"], "spearman_b1": rep["speed"]["spearman_b1"],
           "spearman_batch": rep["speed"]["spearman_batch"],
           "candidates": [{"label": c["label"], "target": c["target"], "decoded_as": c["decoded_as"],
                           "tokens": c["tokens"], "decode_s": c["decode_s"],
                           "predicted_b1_ms": sig(c["predicted_b1_ms"]),
                           "measured_b1_ms": sig((c["measured"] or {}).get("step_b1_ms")),
                           "predicted_batch_ms": sig(c["predicted_ms"]),
                           "measured_batch_ms": sig((c["measured"] or {}).get("step_batch_ms")),
                           "projected": c["projected"] and {k: sig(v) for k, v in c["projected"].items()}}
                          for c in rep["candidates"]],
           "report": str(args.work / "search" / "report.md")}
    try:
        import resource
        res["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 1)
    except ImportError:
        pass
    print(json.dumps(res, indent=1))
    print(f"\npipeline {pipeline_s} s (limit {LIMIT_S}): {'within' if res['within_10_min'] else 'OVER'}; "
          f"{len(finalists)} finalists timed ({len(timed)} with the peers; 6 wanted); "
          f"peak GPU {res['peak_gpu_gb']} GB; "
          f"Spearman batch 1 {res['spearman_b1']}, batch {args.batch} {res['spearman_batch']}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
