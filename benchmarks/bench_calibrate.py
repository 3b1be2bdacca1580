"""Time and peak memory of `ocriaquant calibrate` on a Qwen3.5-4B-shaped model (random weights).

    python benchmarks/bench_calibrate.py --pages 8 --megapixels 4.1 --out /tmp/bench_calib.json

Builds the 4B shape (ocriaquant.model.configs.qwen35_4b_config) with random BF16 weights
and the byte tokenizer, saves it as a model directory, renders synthetic pages at the
requested size (2048x2048 = 4.19 MP -> 4,096 image tokens), and calibrates on the GPU.
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch

from ocriaquant.calibrate import calibrate
from ocriaquant.data.synth import SynthStyle, write_pages
from ocriaquant.model.configs import SHAPES, use_tokenizer_ids
from ocriaquant.model.processor import PageProcessor, build_byte_tokenizer, build_image_processor, save_processor


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=8)
    ap.add_argument("--megapixels", type=float, default=4.1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_calibrate"))
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--shape", default="qwen3.5-4b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    from transformers import Qwen3_5ForConditionalGeneration

    side = int(math.sqrt(args.megapixels * 1e6) // 32 * 32)
    model_dir, pages_dir = args.work / "model", args.work / "pages"
    t = time.time()
    tok = build_byte_tokenizer()
    config = use_tokenizer_ids(SHAPES[args.shape](), tok)
    with torch.device(args.device):
        torch.manual_seed(0)
        model = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    del model
    save_processor(PageProcessor(image_processor=build_image_processor(max_pixels=side * side + 1),
                                 tokenizer=tok, video_processor=None, chat_template=tok.chat_template), model_dir)
    write_pages(pages_dir, args.pages, seed=7, style=SynthStyle(width=side, height=side, font_size=40,
                                                                heading_size=56, subheading_size=48, margin=64))
    setup_s = time.time() - t
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.time()
    res = calibrate(model_dir, pages_dir, args.work / "calib", max_pages=args.pages, batch_size=args.batch_size,
                    device=args.device, dtype=args.dtype, split="all")
    if cuda:
        torch.cuda.synchronize()
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "shape": args.shape, "pages": res.pages,
              "page_px": [side, side], "calibrate_s": round(time.time() - t, 1),
              "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if cuda else None,
              "setup_s": round(setup_s, 1), "batch_size": args.batch_size, "torch": torch.__version__}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
