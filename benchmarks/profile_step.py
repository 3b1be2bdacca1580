"""Where one decode step goes: host loop against device time, and the step's kernels.

    python benchmarks/profile_step.py --shape qwen3.5-4b --plan mixed --batch 1 --out profile.json

Builds the runtime on random weights of a named shape (as `ocriaquant bench --shape` does) and
measures, at one batch size:
- `host_loop_ms`: a step as `ocriaquant bench` times it (bench.decode_speed: the graph replay
  with its argmax, each step launched before the last one's tokens are read back, as the
  engine does);
- `graph_ms`: the captured step alone, replayed back to back between CUDA events, so the
  difference is what the host loop adds to each step;
- the kernels of `--trace-steps` back-to-back replays under torch.profiler (CUPTI traces the
  kernels inside a CUDA graph one by one): kernels per step, the step's time with at least one
  kernel running (`busy_ms`) and with none (`idle_ms`), and the kernels by name with their
  count and time per step. Under PDL a kernel's span includes the time it waits for its
  producer (griddepcontrol.wait), so spans overlap and a kernel's time is not its cost alone;
  OCRIAQUANT_PDL=0 gives the kernels one after another.

`--tiles FILE` builds the runtime with another GEMV tile table (default ocriaquant/recipes/tiles/h200.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from common import add_step_args, step_runtime
from ocriaquant.bench import decode_speed
from ocriaquant.errors import OcriaError


def graph_ms(rt, batch: int, context: int, replays: int = 50) -> tuple:
    """(ms per step: the median over 5 runs of `replays` back-to-back replays, the batch's graph) of a
    ModelRunner's decode step at `batch` rows."""
    from ocriaquant.runtime.model_runner import BUCKETS

    rt.decode_step([0] * batch, list(range(batch)), [context] * batch, [0] * batch)  # captured by now
    graph = rt._graphs[next(b for b in BUCKETS if b >= batch)][0]
    return replay_ms(graph, replays), graph


def replay_ms(graph, replays: int) -> float:
    """ms per replay of a CUDA graph: the median over 5 runs of `replays` back-to-back replays between events."""
    runs = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            graph.replay()
        b.record()
        b.synchronize()
        runs.append(a.elapsed_time(b) / replays)
    return statistics.median(runs)


def kernel_spans(graph, steps: int) -> list[dict]:
    """The kernels of `steps` back-to-back replays: [{name, ts, dur}] in µs, from a chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return [{"name": e["name"], "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0))}
            for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]


def summarize(spans: list[dict], steps: int, top: int) -> dict:
    """Kernels per step, busy and idle time per step (union of the spans), kernels by name."""
    if not spans:
        return {"kernels_per_step": 0, "note": "the profiler recorded no kernels inside the graph"}
    spans = sorted(spans, key=lambda s: s["ts"])
    busy, end = 0.0, spans[0]["ts"]
    for s in spans:  # the union of [ts, ts + dur)
        start, stop = max(s["ts"], end), s["ts"] + s["dur"]
        if stop > start:
            busy += stop - start
        end = max(end, stop)
    window = end - spans[0]["ts"]
    by_name = defaultdict(lambda: [0, 0.0])
    for s in spans:
        by_name[s["name"]][0] += 1
        by_name[s["name"]][1] += s["dur"]
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {"kernels_per_step": round(len(spans) / steps, 1), "window_ms": round(window / steps / 1e3, 4),
            "busy_ms": round(busy / steps / 1e3, 4), "idle_ms": round((window - busy) / steps / 1e3, 4),
            "kernels": [{"name": n[:90], "per_step": round(c / steps, 1), "us_per_step": round(t / steps, 1),
                         "us_each": round(t / c, 2)} for n, (c, t) in rows[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(ap, steps=50)  # host-loop steps timed
    ap.add_argument("--trace-steps", type=int, default=10, help="graph replays traced by the profiler")
    ap.add_argument("--top", type=int, default=20, help="kernels listed, by time per step")
    ap.add_argument("--out", type=Path, default=None, help="write the report here as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_step.py needs a CUDA GPU (it profiles the triton backend's CUDA graphs)")

    t0 = time.perf_counter()
    try:
        rt, vocab = step_runtime(args, "cuda")
    except OcriaError as e:
        sys.exit(f"profile_step.py: {e}")
    host = decode_speed(rt, args.batch, args.context, args.steps, vocab) * 1e3
    dev, graph = graph_ms(rt, args.batch, args.context)
    report = {"shape": args.shape, "plan": args.plan, "batch": args.batch, "context": args.context,
              "max_len": rt.max_len, "tiles": rt.tiles.source, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__,
              "host_loop_ms": round(host, 4), "graph_ms": round(dev, 4), "host_added_ms": round(host - dev, 4)}
    report.update(summarize(kernel_spans(graph, args.trace_steps), args.trace_steps, args.top))
    report["total_s"] = round(time.perf_counter() - t0, 1)
    print(f"{args.shape} {args.plan} batch {args.batch} on {report['gpu']}: host loop {host:.3f} ms/step, "
          f"graph alone {dev:.3f} ms/step (the host loop adds {host - dev:.3f})")
    if report.get("kernels"):
        print(f"{report['kernels_per_step']} kernels a step; some kernel running {report['busy_ms']:.3f} ms, "
              f"none {report['idle_ms']:.3f} ms of {report['window_ms']:.3f}")
        for k in report["kernels"]:
            print(f"  {k['us_per_step']:8.1f} us  {k['per_step']:5.1f} x {k['us_each']:7.2f} us  {k['name']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
