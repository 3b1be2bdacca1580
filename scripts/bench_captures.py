"""The decode step over successive CUDA-graph captures in one process: is a process's first capture
(the one `ocriaquant bench` and the engine replay) as fast as the re-captures ab_step.py times?

    python scripts/bench_captures.py --shape qwen3.5-4b --plan mixed --batch 1 --max-len 5092 \\
        --capture kernels.splitk.TRIGGER_FIRST=1 --capture kernels.splitk.TRIGGER_FIRST=1 \\
        --capture kernels.splitk.TRIGGER_FIRST=1 --capture kernels.splitk.TRIGGER_FIRST=0

Each --capture takes ab_step.py's settings (none: the code as it is); the step is captured anew
under them (the graphs before it kept alive, as ab_step.py does) and timed two ways: the engine's
host loop (bench.decode_speed, `--steps` steps, `--repeats` times) and the graph alone, replayed
back to back between CUDA events, so a difference that is the GPU's shows apart from the host's.
Session 29 (BENCHMARKS.md) found the mixed plan's batch-1 step with splitk.TRIGGER_FIRST=1 at
1.629 / 1.619 / 1.583 ms of GPU time in its first / second / third capture, every time; under 0 the
captures were level. ab_step.py's rounds are re-captures, so it compares settings as the third
capture runs them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from ab_step import apply, forget_captures, parse_setting, undo  # noqa: E402

from ocriaquant.bench import add_step_args, copy_bandwidth, decode_speed, step_bytes, step_runtime  # noqa: E402
from ocriaquant.errors import OcriaError  # noqa: E402


def replay_ms(rt, batch: int, context: int, n: int) -> float:
    """ms per replay of the batch's captured step, n replays back to back from `context`."""
    bucket = next(b for b in sorted(rt._graphs) if b >= batch)
    graph, meta = rt._graphs[bucket][:2]
    rt._write_meta(meta, bucket, [0] * batch, list(range(batch)), [context] * batch, [0] * batch)
    torch.cuda.synchronize(rt.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize(rt.device)
    return start.elapsed_time(end) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(ap, steps=32)
    ap.add_argument("--capture", nargs="*", action="append", required=True, metavar="SETTING",
                    help="one capture, under these settings (ab_step.py's syntax); repeat for more")
    ap.add_argument("--repeats", type=int, default=6, help="host-loop figures per capture")
    ap.add_argument("--replays", type=int, default=256, help="graph replays per GPU-only figure")
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
    for i, (text, settings) in enumerate(zip(args.capture, captures)):
        saved = apply(settings)
        try:
            if i:
                forget_captures(rt, retired)
            host = [decode_speed(rt, args.batch, args.context, args.steps, vocab) * 1e3 for _ in range(args.repeats)]
            gpu = [replay_ms(rt, args.batch, args.context, args.replays) for _ in range(3)]
        finally:
            undo(saved)
        rows.append({"capture": i, "settings": " ".join(text), "host_ms": [round(x, 4) for x in host],
                     "gpu_ms": [round(x, 4) for x in gpu]})
        print(f"capture {i} [{' '.join(text) or 'as is'}]: host {min(host):.3f}-{max(host):.3f} ms, "
              f"graph alone {min(gpu):.4f}-{max(gpu):.4f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"shape": args.shape, "plan": args.plan, "batch": args.batch,
                                        "context": args.context, "max_len": rt.max_len, "steps": args.steps,
                                        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "copy_tb_s": round(bw / 1e12, 3), "bytes_per_step": total,
                                        "captures": rows}, indent=1))


if __name__ == "__main__":
    main()
