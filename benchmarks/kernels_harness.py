"""The harness bench_kernels.py's kernel families share: the 4B's GEMV shapes, CUDA-graph timing over
weight copies rotated past L2, and checked timing (a NaN-poisoned output against a reference first).

Not a tool of its own: bench_kernels.py and its kernels_*.py modules import it (benchmarks/ is on
sys.path when a tool there runs).
"""

from __future__ import annotations

import statistics

import torch

from ocriaquant.quant import fp8, nvfp4
from ocriaquant.runtime.kernels.gemv_nvfp4 import pack_m1

L2_BYTES = 50 * 2**20
# Qwen3.5-4B decode GEMV shapes (N, K): fused units first, then their members.
FUSED = {"gdn_in (qkv+z)": (12288, 2560), "gdn_out / attn_o": (2560, 4096), "mlp_up (gate+up)": (18432, 2560),
         "mlp_down": (2560, 9216), "lm_head": (248320, 2560)}
MEMBERS = {"gdn in_proj_qkv": (8192, 2560), "gdn in_proj_z / attn q_proj": (4096, 2560),
           "mlp gate/up": (9216, 2560), "attn k/v": (1024, 2560)}


def cycled(fns: list, min_launches: int = 64) -> list:
    """fns repeated until the list has at least min_launches calls: a graph replay's own start
    (a few µs) then weighs little on each launch's time."""
    return fns * -(-min_launches // len(fns))


def graph_time_us(fn_list, reps: int = 30) -> float:
    """Median µs per call of a CUDA graph that calls each fn in fn_list once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fn_list:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fn_list:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fn_list))
    return statistics.median(times)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def copies_for(nbytes: int) -> int:
    return max(2, min(16, (4 * L2_BYTES) // max(1, nbytes) + 1))


def weight_copies(n: int, k: int) -> tuple[list, list, list, torch.Tensor]:
    """A random BF16 weight [N, K] in each format, each in enough copies that graph replays
    cycling over them read DRAM, not L2: (BF16 weights, FP8 (codes, scales), NVFP4 (packed,
    scales, pack_m1's batch-1 words, made once as the runtime does at load), NVFP4 global scale).
    Copy 0 of each is the original."""
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    w_q, w_s = fp8.quantize_weight(w)
    packed, scales, gs = nvfp4.quantize_weight(w)
    m1 = pack_m1(packed, scales)
    nc = copies_for(n * k * 2)
    W = [w] + [w.clone() for _ in range(nc - 1)]
    WQ = [(w_q, w_s)] + [(w_q.clone(), w_s.clone()) for _ in range(nc - 1)]
    WP = [(packed, scales, m1)] + [(packed.clone(), scales.clone(), tuple(t.clone() for t in m1))
                                   for _ in range(nc - 1)]
    return W, WQ, WP, gs


def checked_timer(outs: list, ref: torch.Tensor, what: str):
    """timed(call, label): call(0) into a NaN-poisoned outs[0], checked against ref (finite, relative
    error <= 1e-2; else the run stops naming `what` and label), then µs per call of a >= 64-launch
    graph cycling call(i) over the len(outs) weight copies."""
    def timed(call, label):
        outs[0].fill_(float("nan"))
        call(0)
        err = rel(outs[0], ref)
        if not (bool(torch.isfinite(outs[0]).all()) and err <= 1e-2):
            raise SystemExit(f"{what} {label} wrong: rel err {err:.2e}")
        return graph_time_us(cycled([lambda i=i: call(i) for i in range(len(outs))]))
    return timed


def time_tiles(cands: list, fn, timed, pct, log) -> list:
    """Each candidate tile timed (`timed(lambda i: fn(i, tile), tile)`, which checks it first), with
    its µs and % of copy bandwidth; the first candidate is the rule. A tile that fails to compile or
    launch is reported, not fatal."""
    tried = []
    for c in cands:
        try:
            us = timed(lambda i, c=c: fn(i, c), c)
        except Exception as e:  # noqa: BLE001 - e.g. registers or shared memory past the limit: reported
            log(f"  tile {c} failed: {type(e).__name__}: {str(e)[:100]}")
            continue
        tried.append(dict(c, us=round(us, 2), pct=pct(us), rule=c is cands[0]))
    return tried
