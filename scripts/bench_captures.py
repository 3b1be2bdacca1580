"""The decode step over successive CUDA-graph captures in one process: is a process's first capture
(the one `ocriaquant bench` and the engine replay) as fast as the re-captures ab_step.py times?

    python scripts/bench_captures.py --shape qwen3.5-4b --plan mixed --batch 1 --max-len 5092 \\
        --capture kernels.splitk.TRIGGER_FIRST=1 --capture kernels.splitk.TRIGGER_FIRST=1 \\
        --capture kernels.splitk.TRIGGER_FIRST=1 --capture kernels.splitk.TRIGGER_FIRST=0

Each --capture takes ab_step.py's settings (none: the code as it is); the step is captured anew
under them (the graphs before it kept alive, as ab_step.py does) and timed two ways: the engine's
host loop (bench.decode_speed, `--steps` steps, `--repeats` times) and the graph alone, replayed
back to back between CUDA events (profile_step.graph_ms: the median of 5 runs of `--replays`), so a
difference that is the GPU's shows apart from the host's; `--trace-steps` adds each capture's kernels.
Session 29 (BENCHMARKS.md) found the mixed plan's batch-1 step with splitk.TRIGGER_FIRST=1 at
1.629 / 1.619 / 1.583 ms of GPU time in its first / second / third capture, every time; under 0 the
captures were level. ab_step.py's rounds are re-captures, so it compares settings as the third
capture runs them. What differs between captures is where the graph's tensors lie in the memory
pool: `--pad-mb` puts a held block in the pool before the first capture to test that, and each
capture prints how much memory it took.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from ab_step import apply, forget_captures, parse_setting, undo  # noqa: E402
from profile_step import graph_ms, kernel_spans, summarize  # noqa: E402

from ocriaquant.bench import add_step_args, copy_bandwidth, decode_speed, step_bytes, step_runtime  # noqa: E402
from ocriaquant.errors import OcriaError  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(ap, steps=32)
    ap.add_argument("--capture", nargs="*", action="append", required=True, metavar="SETTING",
                    help="one capture, under these settings (ab_step.py's syntax); repeat for more")
    ap.add_argument("--repeats", type=int, default=6, help="host-loop figures per capture")
    ap.add_argument("--replays", type=int, default=256, help="graph replays per GPU-only figure")
    ap.add_argument("--trace-steps", type=int, default=0,
                    help="also trace this many replays of each capture's kernels (profile_step.py's summary), "
                         "to see which kernels a capture's placement slows")
    ap.add_argument("--pad-mb", type=float, default=0,
                    help="before the first capture, a graph holding this many MB of the runtime's memory pool, "
                         "so the step's tensors lie further in: is placement what makes a capture slow?")
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_captures.py: needs a CUDA device (it times CUDA graphs)")
    captures = [[parse_setting(s) for s in c] for c in args.capture]
    try:
        rt, vocab = step_runtime(args, "cuda")
    except OcriaError as e:
        sys.exit(f"bench_captures.py: {e}")
    bw = copy_bandwidth(rt.device)
    total = step_bytes(rt, args.batch, args.context)["total"]
    print(f"copy {bw / 1e12:.2f} TB/s, roofline {total / bw * 1e3:.4f} ms", flush=True)
    rows, retired = [], []
    if args.pad_mb:
        rt._pool = torch.cuda.graph_pool_handle()
        pad = torch.cuda.CUDAGraph()
        with torch.cuda.graph(pad, pool=rt._pool):
            held = torch.empty(int(args.pad_mb * 2**20), dtype=torch.uint8, device=rt.device).fill_(0)
        retired.append((pad, held))
    for i, (text, settings) in enumerate(zip(args.capture, captures)):
        saved = apply(settings)
        try:
            if i:
                forget_captures(rt, retired)
            before = torch.cuda.memory_allocated(rt.device)
            host = [decode_speed(rt, args.batch, args.context, args.steps, vocab) * 1e3 for _ in range(args.repeats)]
            grew = (torch.cuda.memory_allocated(rt.device) - before) / 2**20
            gpu, graph = graph_ms(rt, args.batch, args.context, args.replays)
            kernels = None
            if args.trace_steps:
                kernels = summarize(kernel_spans(graph, args.trace_steps), args.trace_steps, 40)
        finally:
            undo(saved)
        rows.append({"capture": i, "settings": " ".join(text), "host_ms": [round(x, 4) for x in host],
                     "gpu_ms": round(gpu, 4), "memory_grew_mb": round(grew, 1),
                     "kernels": kernels})
        print(f"capture {i} [{' '.join(text) or 'as is'}]: host {min(host):.3f}-{max(host):.3f} ms, "
              f"graph alone {gpu:.4f} ms; memory +{grew:.1f} MB", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"shape": args.shape, "plan": args.plan, "batch": args.batch,
                                        "context": args.context, "max_len": rt.max_len, "steps": args.steps,
                                        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "copy_tb_s": round(bw / 1e12, 3), "bytes_per_step": total,
                                        "pad_mb": args.pad_mb, "captures": rows}, indent=1))


if __name__ == "__main__":
    main()
