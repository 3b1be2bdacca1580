"""Check and time ocriaquant's decode kernels at Qwen3.5-4B shapes beside their baselines, in one run.

    python scripts/bench_kernels.py --out bench_kernels.json
    python scripts/bench_kernels.py --only table --table recipes/latency_h200.json

- gemv_bf16 / gemv_fp8 / gemv_nvfp4 against cuBLAS BF16 (F.linear) and torch._scaled_mm (FP8,
  row-wise scales), M = 1…64, on the 4B's fused and member shapes;
- gdn_decode against fla-core's fused_recurrent_gated_delta_rule plus the transformers glue
  around it (conv update, split, gates, head repeat, gated RMSNorm), B = 1, 32, 64;
- silu_mul_quant against the unfused torch sequence, M = 64, 256;
- the floor (`--only floor`): the fastest plain read found of each GEMV shape's bytes under
  this harness. A read-only stream (`stream_read`, every program xor-reduces contiguous
  16-byte words and writes one word), swept over grid size, warps, loads in flight and PDL,
  beside the runtime's FP8 / NVFP4 GEMVs on the same bytes, in graphs of >= 64 launches so that
  the replay's own start is spread thin. Where the best stream misses a % of the copy
  bandwidth, a GEMV that must read those bytes and compute too is not expected to reach it;
- the floor of a read that must also wait for its input (`--only floorx`, batch 1, N = 2560
  shapes): stream_read again, reading an activation K-step from L2 after the PDL wait before
  its first reduction, as every GEMV must;
- the GEMVs of the floor run alone (`--only rules`): the runtime's FP8 / NVFP4 launches at their
  tiles.py tiles in the same long graphs, without the stream sweep;
- FP8 tiles (`--only fp8`): gemv_fp8's tiles at each batch, the tensor-core form's swept
  above batch 1, beside the old form, cuBLAS BF16 and _scaled_mm (what tiles.dot_tile is from);
- batch-1 tiles (`--only m1`): gemv_fp8's and gemv_nvfp4's on the N = 2560 shapes (M1_TILES_N2560) and
  the K = 2560 input projections (M1_TILES_K2560), beside the rule tile tiles.m1_tile gives them, in the
  same long graphs.

Every kernel is first checked against its float64 reference on fresh random inputs with a
NaN-poisoned output. Times are medians of CUDA-graph replays, each replay cycling over enough
weight copies that nothing is served from L2. Achieved bandwidth is reported against the
device-to-device copy bandwidth measured in the same run.

The latency table (what `ocriaquant search --latency-table` reads) times, per shape, format and
batch, what the runtime's QuantLinear launches (`--only table`, no tile sweep, about a minute):
at batch 1 the GEMV kernels at the tiles kernels/tiles.py gives them, with PDL as the runtime
launches them; above batch 1 gemv_fp8 for FP8 and cuBLAS on the BF16 (or dequantized NVFP4)
weight. The sweep's best tiles (`--only gemv`) are what tiles.py is tuned from, not what runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ocriaquant.bench import copy_bandwidth
from ocriaquant.quant import fp8, nvfp4
from ocriaquant.runtime.kernels.gemv_nvfp4 import gemv_nvfp4_silu, nvfp4_x_pairs, pack_m1
from ocriaquant.runtime.kernels.splitk import geometry, wait_for_inputs
from ocriaquant.runtime.kernels.tiles import m1_tile
from ocriaquant.runtime.kernels import (gdn_decode, gdn_decode_ref, gemv_bf16, gemv_bf16_ref, gemv_fp8, gemv_fp8_quantizing,
                                        gemv_fp8_ref, gemv_nvfp4,
                                        gemv_nvfp4_ref, quant_fp8_per_token, silu_mul_quant, silu_mul_quant_ref)

L2_BYTES = 50 * 2**20
# Qwen3.5-4B decode GEMV shapes (N, K): fused units first, then their members.
FUSED = {"gdn_in (qkv+z)": (12288, 2560), "gdn_out / attn_o": (2560, 4096), "mlp_up (gate+up)": (18432, 2560),
         "mlp_down": (2560, 9216), "lm_head": (248320, 2560)}
# The shape whose FP8 GEMV quantizes its own input at batch 1 in the runtime (gdn_decode / attention
# hand it their output's absmax): the latency table times that form (tiles kind fp8_qx) there.
QUANTIZING = "gdn_out / attn_o"
MEMBERS = {"gdn in_proj_qkv": (8192, 2560), "gdn in_proj_z / attn q_proj": (4096, 2560),
           "mlp gate/up": (9216, 2560), "attn k/v": (1024, 2560)}


@triton.jit
def stream_read_kernel(src_ptr, out_ptr, iters, x_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                       X_WORDS: tl.constexpr):
    """The floor of a weight stream: program p xors words [p·iters·BLOCK, (p+1)·iters·BLOCK) of
    src (int32) and writes the one word to out[p]. Like the GEMVs, it issues its first block
    before the PDL wait and the next block before it reduces the current one. X_WORDS > 0: after
    the wait it also reads X_WORDS words at x_ptr (an activation K-step, from L2, as a GEMV's
    first product must) and folds their xor into the result before reducing its first block."""
    base = tl.program_id(0).to(tl.int64) * iters * BLOCK
    offs = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), BLOCK), BLOCK)
    cur = tl.load(src_ptr + base + offs, eviction_policy="evict_first")
    wait_for_inputs(PDL)  # as the GEMVs wait: PDL 1 the next launch after the wait, 2 before it
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    if X_WORDS > 0:
        xs = tl.xor_sum(tl.load(x_ptr + tl.arange(0, X_WORDS)), 0)
        acc = tl.where(offs == 0, xs, acc)  # once, not in every lane: the result then depends on x
    for i in range(1, iters):
        nxt = tl.load(src_ptr + base + i * BLOCK + offs, eviction_policy="evict_first")
        acc ^= cur
        cur = nxt
    acc ^= cur
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


def stream_read(src: torch.Tensor, out: torch.Tensor, iters: int, block: int, num_warps: int = 4,
                pdl: int = 0, x: torch.Tensor | None = None) -> int:
    """Launch stream_read_kernel over the first programs · iters · block words of src (int32),
    programs = len(out), with x (int32, a power-of-two length) read after the wait if given;
    returns the weight words read. pdl: 0 off, 1 the next launch after the wait, 2 before it."""
    programs = out.numel()
    if programs * iters * block > src.numel():
        raise ValueError(f"stream_read: {programs} x {iters} x {block} words past a source of {src.numel()}")
    if x is not None and (x.dtype != torch.int32 or x.numel() & (x.numel() - 1)):
        raise ValueError(f"stream_read: x must be int32 words, a power of two of them, got {x.numel()} {x.dtype}")
    pdl = int(pdl) if src.is_cuda else 0
    stream_read_kernel[(programs,)](src, out, iters, src if x is None else x, BLOCK=block, PDL=pdl,
                                    X_WORDS=0 if x is None else x.numel(), num_warps=num_warps,
                                    launch_pdl=pdl > 0)
    return programs * iters * block


def stream_read_ref(src: torch.Tensor, programs: int, iters: int, block: int,
                    x: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: what stream_read writes, each program's words xor-reduced (block a power of
    two), xored with the xor of x's words if given."""
    w = src[:programs * iters * block].view(programs, iters, block)
    while w.shape[-1] > 1:
        half = w.shape[-1] // 2
        w = w[..., :half] ^ w[..., half:]
    acc = w[:, 0, 0].clone()
    for i in range(1, iters):
        acc ^= w[:, i, 0]
    if x is not None:
        xs = x.clone()
        while xs.numel() > 1:
            xs = xs[:xs.numel() // 2] ^ xs[xs.numel() // 2:]
        acc ^= xs[0]
    return acc


def stream_configs(words: int, sms: int) -> list[dict]:
    """(programs, iters, block, warps) that read at least 97 % of `words` with no masks: 1, 2, 4
    or 8 16-byte loads per thread a block, 1-16 blocks a program, at least half a wave of programs."""
    out = []
    for warps in (4, 8):
        for vec in (1, 2, 4, 8):
            block = warps * 32 * 4 * vec
            for iters in (1, 2, 3, 4, 6, 8, 12, 16):
                programs = words // (iters * block)
                if programs >= sms // 2 and programs * iters * block >= 0.97 * words:
                    out.append(dict(programs=programs, iters=iters, block=block, num_warps=warps))
    return out


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


def bench_gemv(shapes: dict, ms: list[int], bw: float, log) -> list:
    rows = []
    for name, (n, k) in shapes.items():
        W, WQ, WP, gs = weight_copies(n, k)
        nc = len(W)
        (w_q, w_s), (packed, scales, _) = WQ[0], WP[0]
        best_cfg = {}
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            x_q, x_s = quant_fp8_per_token(x)
            # At M = 1 the runtime's producers hand the GEMVs their activations ready (half2.py):
            # timed that way, made here once.
            fp8_kw = dict(x_half=quant_fp8_per_token(x, half=True)[2]) if m == 1 else {}
            nv_kw = dict(x_pairs=nvfp4_x_pairs(x)) if m == 1 else {}
            m1_kw = (lambda i: dict(m1=WP[i][2])) if m == 1 else (lambda i: {})
            # Correctness, fresh inputs, poisoned outputs.
            for fmt in ("bf16", "fp8", "nvfp4"):
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                if fmt == "bf16":
                    gemv_bf16(x, W[0], out=out)
                    err = rel(out, gemv_bf16_ref(x, W[0]))
                elif fmt == "fp8":
                    gemv_fp8(x_q, x_s, w_q, w_s, out=out, **fp8_kw)
                    err = rel(out, gemv_fp8_ref(x_q, x_s, w_q, w_s))
                else:
                    gemv_nvfp4(x, packed, scales, gs, out=out, **nv_kw, **m1_kw(0))
                    err = rel(out, gemv_nvfp4_ref(x, packed, scales, gs))
                ok = bool(torch.isfinite(out).all()) and err <= 1e-2
                if not ok:
                    raise SystemExit(f"{fmt} GEMV wrong at {name} M={m}: rel err {err:.2e}, finite "
                                     f"{bool(torch.isfinite(out).all())}")
            t = {}
            outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(nc)]
            t["bf16 cuBLAS"] = graph_time_us([lambda i=i: torch.mm(x, W[i].T, out=outs[i]) for i in range(nc)])
            try:
                ws_row = w_s.float().reshape(1, n)
                xs = x_s.float()
                t["fp8 _scaled_mm"] = graph_time_us([lambda i=i: torch._scaled_mm(
                    x_q, WQ[i][0].T, scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16) for i in range(nc)])
            except Exception as e:  # noqa: BLE001 - shapes _scaled_mm refuses are reported, not fatal
                log(f"  _scaled_mm unavailable at M={m}: {type(e).__name__}: {str(e)[:80]}")
                t["fp8 _scaled_mm"] = float("nan")
            tiles = ((16, 256, 4), (32, 256, 4), (32, 512, 4), (64, 256, 8))
            if m == 1:  # the CUDA-core paths: narrow long tiles (bf16), many rows per thread (half2)
                tiles += ((16, 512, 4), (64, 256, 4), (64, 512, 8), (128, 256, 8), (8, 1024, 4), (64, 128, 4),
                          (128, 128, 4), (128, 256, 4), (256, 128, 8))
            cfgs = [dict(block_n=bn, block_k=bk, num_warps=nw, split_k=sk) for bn, bk, nw in tiles
                    for sk in (None, "x2")]
            for fmt, fn in (("bf16", lambda i, c: gemv_bf16(x, W[i], out=outs[i], **c)),
                            ("fp8", lambda i, c: gemv_fp8(x_q, x_s, WQ[i][0], WQ[i][1], out=outs[i], **c, **fp8_kw)),
                            ("nvfp4", lambda i, c: gemv_nvfp4(x, WP[i][0], WP[i][1], gs, out=outs[i], **c, **nv_kw,
                                                              **m1_kw(i)))):
                key = (fmt, n, k, m == 1)  # the M = 1 and tensor-core paths tune apart
                cands = cfgs if key not in best_cfg else [best_cfg[key]]
                res = []

                def attempt(c):
                    if c.get("split_k") == "x2":  # twice the automatic split (more CTAs in flight)
                        c = {**c, "split_k": 2 * geometry(n, k, c["block_n"], c["block_k"], x.device)[1]}
                    try:
                        res.append((graph_time_us([lambda i=i, c=c: fn(i, c) for i in range(nc)]), c))
                    except Exception as e:  # noqa: BLE001
                        log(f"  {fmt} config {c} failed: {type(e).__name__}: {str(e)[:100]}")

                for c in cands:
                    attempt(c)
                if not res:  # the tile that won at a smaller M does not fit this one: search again
                    for c in cfgs:
                        attempt(c)
                us, c = min(res, key=lambda r: r[0])
                best_cfg.setdefault(key, c)
                t[f"{fmt} ours"] = us
            if m == 1:  # each format's best tile again with programmatic dependent launch (splitk.use_pdl)
                for fmt, fn in (("bf16", lambda i, c: gemv_bf16(x, W[i], out=outs[i], **c)),
                                ("fp8", lambda i, c: gemv_fp8(x_q, x_s, WQ[i][0], WQ[i][1], out=outs[i], **c, **fp8_kw)),
                                ("nvfp4", lambda i, c: gemv_nvfp4(x, WP[i][0], WP[i][1], gs, out=outs[i], **c,
                                                                  **nv_kw, **m1_kw(i)))):
                    c = best_cfg[(fmt, n, k, True)]
                    if c.get("split_k") == "x2":
                        c = {**c, "split_k": 2 * geometry(n, k, c["block_n"], c["block_k"], x.device)[1]}
                    try:
                        t[f"{fmt} PDL"] = graph_time_us([lambda i=i, c=c: fn(i, {**c, "pdl": True}) for i in range(nc)])
                    except Exception as e:  # noqa: BLE001 - a Triton or driver without PDL: reported, not fatal
                        log(f"  {fmt} with PDL failed: {type(e).__name__}: {str(e)[:120]}")
                        t[f"{fmt} PDL"] = float("nan")
                log(f"  with PDL: bf16 {t['bf16 PDL']:.1f}us, fp8 {t['fp8 PDL']:.1f}us, nvfp4 {t['nvfp4 PDL']:.1f}us")
            if m == 1:  # session 4's fp32 CUDA-core FP8 path (gemv_m1), at its tile, for comparison
                fma = m1_tile("bf16", n, k)  # the fp32 kernel's tiles (tiles.py)
                t["fp8 fma"] = graph_time_us([lambda i=i: gemv_fp8(x_q, x_s, WQ[i][0], WQ[i][1], out=outs[i],
                                                                   path="fma", **fma) for i in range(nc)])
            wbytes = {"bf16": n * k * 2, "fp8": n * k + n * 2, "nvfp4": n * k // 2 + n * k // 16}
            io = m * k * 2 + m * n * 2
            row = {"shape": name, "n": n, "k": k, "m": m, **{f"{kk} us": round(v, 2) for kk, v in t.items()}}
            for fmt, key in (("bf16", "bf16 cuBLAS"), ("bf16 ours", "bf16 ours"), ("fp8", "fp8 ours"),
                             ("nvfp4", "nvfp4 ours")) + ((("fp8 fma", "fp8 fma"),) if m == 1 else ()):
                row[f"{fmt} %bw"] = round(100 * (wbytes[fmt.split()[0]] + io) / (t[key] * 1e-6) / bw, 1)
            row["bf16 ours vs cuBLAS"] = round(t["bf16 cuBLAS"] / t["bf16 ours"], 2)
            row["fp8 vs cuBLAS"] = round(t["bf16 cuBLAS"] / t["fp8 ours"], 2)
            row["nvfp4 vs cuBLAS"] = round(t["bf16 cuBLAS"] / t["nvfp4 ours"], 2)
            row["fp8 vs _scaled_mm"] = round(t["fp8 _scaled_mm"] / t["fp8 ours"], 2)
            row["config"] = {f: best_cfg[(f, n, k, m == 1)] for f in ("bf16", "fp8", "nvfp4")}
            rows.append(row)
            log(f"{name:28s} M={m:<3d} cuBLAS {t['bf16 cuBLAS']:8.1f}us ({row['bf16 %bw']:5.1f}%)  bf16 "
                f"{t['bf16 ours']:8.1f}us ({row['bf16 ours %bw']:5.1f}%)  fp8 "
                f"{t['fp8 ours']:8.1f}us ({row['fp8 %bw']:5.1f}%)  _scaled_mm {t['fp8 _scaled_mm']:8.1f}us  nvfp4 "
                f"{t['nvfp4 ours']:8.1f}us ({row['nvfp4 %bw']:5.1f}%)")
        del W, WQ, WP
        torch.cuda.empty_cache()
    return rows


def runtime_table(shapes: dict, ms: list[int], log) -> list:
    """Per (N, K, format, batch): µs of what layers.QuantLinear.forward_kernels launches (see the
    module docstring), each output checked against its float64 reference first."""
    table = []
    for name, (n, k) in shapes.items():
        W, WQ, WP, gs = weight_copies(n, k)
        nc, w = len(W), W[0]
        (w_q, w_s), (packed, scales, _) = WQ[0], WP[0]
        w_nv = nvfp4.dequantize(packed, scales, gs, torch.bfloat16)  # what the runtime runs above batch 1
        WN = [w_nv] + [w_nv.clone() for _ in range(nc - 1)]
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            x_q, x_s, *half = quant_fp8_per_token(x, half=m == 1)
            outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(nc)]
            if m == 1:
                pairs = nvfp4_x_pairs(x)
                amax = x.float().abs().amax().reshape(1)
                fp8_m1 = (lambda i: gemv_fp8_quantizing(x, amax, *WQ[i], out=outs[i], **m1_tile("fp8_qx", n, k))) \
                    if name == QUANTIZING else \
                    (lambda i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i], x_half=half[0], **m1_tile("fp8", n, k)))
                fns = {"bf16": lambda i: gemv_bf16(x, W[i], out=outs[i], **m1_tile("bf16", n, k)),
                       "fp8": fp8_m1,
                       "nvfp4": lambda i: gemv_nvfp4(None, WP[i][0], WP[i][1], gs, out=outs[i], x_pairs=pairs,
                                                     m1=WP[i][2], **m1_tile("nvfp4", n, k))}
            else:
                fns = {"bf16": lambda i: torch.mm(x, W[i].T, out=outs[i]),
                       "fp8": lambda i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i]),
                       "nvfp4": lambda i: torch.mm(x, WN[i].T, out=outs[i])}
            refs = {"bf16": gemv_bf16_ref(x, w), "fp8": gemv_fp8_ref(x_q, x_s, w_q, w_s),
                    "nvfp4": gemv_nvfp4_ref(x, packed, scales, gs)}
            line = []
            for fmt, fn in fns.items():
                outs[0].fill_(float("nan"))
                fn(0)
                err = rel(outs[0], refs[fmt])
                if not (bool(torch.isfinite(outs[0]).all()) and err <= 1e-2):
                    raise SystemExit(f"{fmt} at {name} M={m} as the runtime runs it: rel err {err:.2e}")
                us = graph_time_us([lambda i=i, fn=fn: fn(i) for i in range(nc)])
                table.append({"n": n, "k": k, "format": fmt, "batch": m, "us": round(us, 3)})
                line.append(f"{fmt} {us:7.1f}us")
            log(f"{name:28s} M={m:<3d} " + "  ".join(line))
        del W, WN, WQ, WP
        torch.cuda.empty_cache()
    return table


def bench_floor(shapes: dict, ms: list[int], bw: float, log, sweep: bool = True, x_words: int = 0,
                pdl_modes: tuple = (0, 1, 2)) -> list:
    """Per shape: the fastest stream_read of its FP8 and NVFP4 weight bytes (copies rotated past
    L2, the best of stream_configs with and without PDL), beside the runtime's GEMVs on the
    same shape (QuantLinear's launches: batch 1 at the tiles.py tile, above it gemv_fp8), all in
    graphs of at least 64 launches; the GEMVs also in bench_gemv's short graphs (one launch per
    weight copy) to show what the replay's start adds there. %bw as bench_gemv counts it:
    (weights + scales + activations + output) / time / copy bandwidth. sweep False (--only
    rules): the GEMVs alone, no stream_read sweep, in a fraction of the time. x_words (--only
    floorx): the sweep again with an activation read of that many words after the wait, on
    which the first reduction depends (stream_read's x), the floor of a GEMV that must wait for
    its input before its first product. pdl_modes: the PDL orders swept (stream_read's pdl)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, (n, k) in shapes.items():
        W, WQ, WP, gs = weight_copies(n, k)
        nc = len(W)
        del W
        for fmt, wbytes in (("fp8", n * k + n * 2), ("nvfp4", n * k // 2 + n * k // 16)):
            words = wbytes // 4
            srcs = [torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device="cuda")
                    for _ in range(copies_for(wbytes))]
            xw = torch.randint(-2**31, 2**31 - 1, (x_words,), dtype=torch.int32, device="cuda") if x_words else None
            best, best_x, by_mode = None, None, {}
            for c in stream_configs(words, sms) if sweep else []:
                outs = [torch.empty(c["programs"], dtype=torch.int32, device="cuda") for _ in srcs]
                for x in (None, xw) if x_words else (None,):
                    outs[0].fill_(-1)
                    read = stream_read(srcs[0], outs[0], c["iters"], c["block"], c["num_warps"], x=x)
                    if not torch.equal(outs[0], stream_read_ref(srcs[0], c["programs"], c["iters"], c["block"], x)):
                        raise SystemExit(f"stream_read wrong at {c}" + (" with x" if x is not None else ""))
                    for pdl in pdl_modes:
                        us = graph_time_us(cycled([lambda i=i: stream_read(srcs[i], outs[i], c["iters"], c["block"],
                                                                           c["num_warps"], pdl, x)
                                                   for i in range(len(srcs))]))
                        key = f"{'x' if x is not None else 'plain'}_pdl{pdl}"
                        by_mode[key] = min(us, by_mode.get(key, us))
                        top = best if x is None else best_x
                        if top is None or us < top["us"]:
                            top = dict(c, pdl=pdl, us=us, read_fraction=round(read / words, 4))
                            best, best_x = (top, best_x) if x is None else (best, top)
            del srcs
            for m in ms if fmt == "fp8" else [1]:
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                io = m * k * 2 + m * n * 2
                outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(nc)]
                if fmt == "fp8":
                    x_q, x_s, *half = quant_fp8_per_token(x, half=m == 1)
                    kw = dict(x_half=half[0], **m1_tile("fp8", n, k)) if m == 1 else {}
                    fns = [lambda i=i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i], **kw) for i in range(nc)]
                    outs[0].fill_(float("nan"))
                    fns[0]()
                    err = rel(outs[0], gemv_fp8_ref(x_q, x_s, *WQ[0]))
                else:
                    pairs = nvfp4_x_pairs(x)
                    fns = [lambda i=i: gemv_nvfp4(None, WP[i][0], WP[i][1], gs, out=outs[i], x_pairs=pairs, m1=WP[i][2],
                                                  **m1_tile("nvfp4", n, k)) for i in range(nc)]
                    outs[0].fill_(float("nan"))
                    fns[0]()
                    err = rel(outs[0], gemv_nvfp4_ref(x, WP[0][0], WP[0][1], gs))
                if not (bool(torch.isfinite(outs[0]).all()) and err <= 1e-2):
                    raise SystemExit(f"{fmt} GEMV wrong at {name} M={m}: rel err {err:.2e}")
                long_us, short_us = graph_time_us(cycled(fns)), graph_time_us(fns)
                pct = lambda us: round(100 * (wbytes + io) / (us * 1e-6) / bw, 1)  # noqa: E731
                r = {"shape": name, "n": n, "k": k, "format": fmt, "m": m, "bytes": wbytes + io,
                     "gemv_us": round(long_us, 2), "gemv %bw": pct(long_us),
                     "gemv_short_graph_us": round(short_us, 2), "gemv short %bw": pct(short_us), "rel_err": err}
                floor = ""
                if best is not None:
                    r.update({"floor_us": round(best["us"], 2), "floor %bw": pct(best["us"]),
                              "floor_config": {kk: v for kk, v in best.items() if kk != "us"},
                              "gemv / floor": round(long_us / best["us"], 2)})
                    floor = f"floor {r['floor_us']:7.2f}us ({r['floor %bw']:5.1f}%)  "
                if best_x is not None:
                    r.update({"floor_x_us": round(best_x["us"], 2), "floor_x %bw": pct(best_x["us"]),
                              "floor_x_config": {kk: v for kk, v in best_x.items() if kk != "us"},
                              "x_words": x_words})
                    floor += f"with x {r['floor_x_us']:7.2f}us ({r['floor_x %bw']:5.1f}%)  "
                if by_mode:  # the best read under each PDL order: off, next launch after the wait, before it
                    r["floor_by_pdl %bw"] = {kk: pct(v) for kk, v in sorted(by_mode.items())}
                    floor += "by pdl " + " ".join(f"{kk} {pct(v):.1f}" for kk, v in sorted(by_mode.items())) + "  "
                rows.append(r)
                log(f"{name:20s} {fmt:5s} M={m:<3d} {(wbytes + io) / 1e6:7.1f} MB  {floor}gemv {r['gemv_us']:7.2f}us "
                    f"({r['gemv %bw']:5.1f}%; short graph {r['gemv_short_graph_us']:.2f}us, {r['gemv short %bw']}%)"
                    + (f"  gemv/floor {r['gemv / floor']}" if floor else ""))
        del WQ, WP
        torch.cuda.empty_cache()
    return rows


# gemv_dot(swap=True) tiles above batch 1: (block_n, block_k, num_warps, num_stages)
DOT_TILES = ((32, 256, 4, 3), (32, 512, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (64, 512, 4, 3), (128, 128, 4, 3),
             (128, 128, 4, 4), (128, 256, 4, 3))
# Batch-1 (half2) tiles tried on the N = 2560 shapes, per format: (block_n, block_k, num_warps, split_k),
# those whose block_k divides K. The whole-K rows (block_k = K's largest power-of-two part, unsplit: each
# CTA issues all its weight loads before its PDL wait, and no split-K reduction remains) are session 24's.
M1_TILES_N2560 = {
    "fp8": ((8, 2048, 8, 1), (8, 1024, 8, 1), (8, 1024, 4, 1), (16, 1024, 8, 1), (16, 512, 8, 2),
            (32, 512, 8, 2), (32, 512, 8, 4), (64, 256, 8, 4), (64, 512, 8, 4), (128, 256, 8, 4),
            (128, 512, 8, 4), (256, 256, 8, 8), (64, 512, 8, 3),
            (4, 4096, 4, 1), (8, 4096, 8, 1), (16, 4096, 8, 1), (4, 4096, 2, 1), (8, 2048, 4, 1),
            (4, 1024, 2, 1), (8, 1024, 2, 1), (16, 1024, 4, 1), (32, 1024, 8, 1), (16, 2048, 8, 1),
            (4, 4096, 8, 1), (16, 4096, 4, 1)),
    "nvfp4": ((16, 512, 4, 4), (32, 512, 8, 4), (64, 512, 8, 3), (128, 512, 8, 3), (128, 512, 8, 8),
              (64, 1024, 8, 3), (32, 1024, 8, 3), (8, 1024, 4, 1), (16, 1024, 4, 2), (16, 1024, 8, 1),
              (4, 4096, 4, 1), (8, 4096, 4, 1), (8, 4096, 8, 1), (4, 4096, 2, 1), (16, 4096, 8, 1),
              (4, 2048, 4, 1), (8, 2048, 4, 1), (4, 1024, 2, 1), (4, 1024, 4, 1), (4, 4096, 8, 1)),
}
# ... and on the K = 2560 input projections (gdn_in 12288, mlp_up 18432; session 25): the 4-warp gate_up
# tile, the 8-warp wide ones, and splits of one K-tile each (every load before the PDL wait)
M1_TILES_K2560 = {
    "fp8": ((32, 512, 4, 1), (16, 512, 4, 1), (64, 512, 4, 1), (128, 256, 8, 1), (256, 128, 8, 1), (32, 256, 4, 1),
            (64, 256, 8, 1), (8, 512, 4, 5), (16, 512, 4, 5), (32, 512, 4, 5), (64, 512, 8, 5), (32, 512, 8, 1)),
    "nvfp4": ((32, 512, 4, 1), (16, 512, 4, 1), (64, 512, 4, 1), (32, 512, 8, 1), (128, 512, 8, 1), (16, 256, 4, 1),
              (32, 256, 4, 1), (64, 256, 4, 1), (64, 256, 8, 1), (8, 512, 4, 5), (16, 512, 4, 5), (32, 512, 4, 5),
              (32, 512, 8, 5), (16, 512, 2, 5), (8, 512, 2, 5), (32, 512, 2, 1)),
}


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


def m1_candidates(kind: str, n: int, k: int) -> list:
    """The rule tile of `kind` at (n, k), then M1_TILES_N2560[kind] on the N = 2560 shapes, M1_TILES_K2560[kind] on
    the K = 2560 input projections."""
    tiles = M1_TILES_N2560[kind] if n == 2560 else M1_TILES_K2560[kind] if k == 2560 and n < 65536 else ()
    return [dict(m1_tile(kind, n, k))] + [dict(block_n=a, block_k=b, num_warps=c, split_k=d) for a, b, c, d in tiles
                                          if k % b == 0]


def bench_m1_tiles(shapes: dict, bw: float, log) -> list:
    """Batch-1 tiles of gemv_fp8 and gemv_nvfp4 (activations ready, as the runtime's producers hand
    them), each checked against float64 on a poisoned output and timed in graphs of >= 64 launches:
    the rule tile, and M1_TILES_N2560 / M1_TILES_K2560 (m1_candidates)."""
    rows = []
    for name, (n, k) in shapes.items():
        _, WQ, WP, gs = weight_copies(n, k)
        nc = len(WQ)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        x_q, x_s, half = quant_fp8_per_token(x, half=True)
        pairs = nvfp4_x_pairs(x)
        outs = [torch.empty(1, n, dtype=torch.bfloat16, device="cuda") for _ in range(nc)]
        calls = {"fp8": (lambda i, c: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i], x_half=half, **c),
                         gemv_fp8_ref(x_q, x_s, *WQ[0]), n * k + n * 2),
                 "nvfp4": (lambda i, c: gemv_nvfp4(None, WP[i][0], WP[i][1], gs, out=outs[i], x_pairs=pairs,
                                                   m1=WP[i][2], **c),
                           gemv_nvfp4_ref(x, WP[0][0], WP[0][1], gs), n * k // 2 + n * k // 16)}
        for fmt, (fn, ref, wbytes) in calls.items():
            io = k * 2 + n * 2
            pct = lambda us, b=wbytes + io: round(100 * b / (us * 1e-6) / bw, 1)  # noqa: E731
            timed = checked_timer(outs, ref, f"{fmt} at {name} M=1, tile")
            tried = time_tiles(m1_candidates(fmt, n, k), fn, timed, pct, log)
            best = min(tried, key=lambda t: t["us"])
            rule = next(t for t in tried if t["rule"])
            rows.append({"shape": name, "n": n, "k": k, "format": fmt, "bytes": wbytes + io, "best": best,
                         "rule": rule, "tried": tried})
            log(f"{name:20s} {fmt:5s} M=1 rule {rule['us']:6.2f}us ({rule['pct']:5.1f}%)  best {best['us']:6.2f}us "
                f"({best['pct']:5.1f}%) {({kk: v for kk, v in best.items() if kk not in ('us', 'pct', 'rule')})}")
        del WQ, WP
        torch.cuda.empty_cache()
    return rows


def bench_fp8_tiles(shapes: dict, ms: list[int], bw: float, log) -> list:
    """FP8 GEMV tiles, each checked against float64 on a poisoned output, timed in graphs of >= 64
    launches: above batch 1 gemv_dot's swapped form over DOT_TILES (½, 1, 2, 4 × the auto split) beside
    the plain form at its old default (16 x 256, 4 warps, 4 stages), cuBLAS BF16 and _scaled_mm;
    at batch 1 the rule tile and, on the N = 2560 shapes, M1_TILES_N2560."""
    from ocriaquant.runtime.kernels.gemv_dot import gemv_dot

    rows = []
    for name, (n, k) in shapes.items():
        W, WQ, _, _ = weight_copies(n, k)
        nc = len(W)
        w_q, w_s = WQ[0]
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            x_q, x_s, *half = quant_fp8_per_token(x, half=m == 1)
            ref = gemv_fp8_ref(x_q, x_s, w_q, w_s)
            outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(nc)]
            wbytes, io = n * k + n * 2, m * k * 2 + m * n * 2
            pct = lambda us: round(100 * (wbytes + io) / (us * 1e-6) / bw, 1)  # noqa: E731
            timed = checked_timer(outs, ref, f"fp8 at {name} M={m},")

            base = {}
            base["bf16 cuBLAS"] = graph_time_us(cycled([lambda i=i: torch.mm(x, W[i].T, out=outs[i]) for i in range(nc)]))
            try:
                base["_scaled_mm"] = graph_time_us(cycled([lambda i=i: torch._scaled_mm(
                    x_q, WQ[i][0].T, scale_a=x_s.float(), scale_b=w_s.float().reshape(1, n),
                    out_dtype=torch.bfloat16) for i in range(nc)]))
            except Exception as e:  # noqa: BLE001 - shapes _scaled_mm refuses are reported, not fatal
                log(f"  _scaled_mm unavailable at M={m}: {type(e).__name__}: {str(e)[:80]}")
                base["_scaled_mm"] = float("nan")
            tried = []
            if m == 1:
                tried = time_tiles(m1_candidates("fp8", n, k),
                                   lambda i, c: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i], x_half=half[0], **c), timed,
                                   pct, log)
            else:
                base["plain dot"] = timed(lambda i: gemv_dot(x_q, WQ[i][0], x_s, WQ[i][1], out=outs[i], block_n=16,
                                                             block_k=256, num_warps=4, num_stages=4), "plain dot")
                # the lm_head: many row tiles and no split already; its two fastest of session 22
                for bn, bk, nw, st in DOT_TILES if n < 65536 else ((64, 256, 4, 3), (128, 128, 4, 3)):
                    auto = geometry(n, k, bn, bk, x.device)[1]
                    # half, once, twice and four times the automatic split, each split >= 2 K-steps
                    for split in sorted({sp for sp in (max(1, auto // 2), auto, 2 * auto, 4 * auto)
                                         if k // sp >= 2 * bk} or {1}):
                        c = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=st, split_k=split)
                        try:
                            us = timed(lambda i, c=c: gemv_dot(x_q, WQ[i][0], x_s, WQ[i][1], out=outs[i], swap=True,
                                                               **c), c)
                        except Exception as e:  # noqa: BLE001 - e.g. shared memory past the limit: reported
                            log(f"  dot tile {c} failed: {type(e).__name__}: {str(e)[:100]}")
                            continue
                        tried.append(dict(c, us=round(us, 2), pct=pct(us), auto_split=split == auto))
                base["rule"] = timed(lambda i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i]), "rule")
            best = min(tried, key=lambda t: t["us"])
            row = {"shape": name, "n": n, "k": k, "m": m, "bytes": wbytes + io, "best": best,
                   "best %bw": best["pct"], **{f"{kk} us": round(v, 2) for kk, v in base.items()},
                   "best vs cuBLAS": round(base["bf16 cuBLAS"] / best["us"], 2),
                   "best vs _scaled_mm": round(base["_scaled_mm"] / best["us"], 2), "tried": tried}
            if m > 1:
                row["rule %bw"] = pct(base["rule"])
                row["best vs plain dot"] = round(base["plain dot"] / best["us"], 2)
            rows.append(row)
            tile = {kk: best[kk] for kk in best if kk not in ("us", "pct", "rule", "auto_split")}
            log(f"{name:20s} M={m:<3d} best {best['us']:7.2f}us ({best['pct']:5.1f}%) {tile}  cuBLAS "
                f"{base['bf16 cuBLAS']:.2f}us  _scaled_mm {base['_scaled_mm']:.2f}us"
                + (f"  plain dot {base['plain dot']:.2f}us  rule {base['rule']:.2f}us ({row['rule %bw']}%)"
                   if m > 1 else ""))
        del W, WQ
        torch.cuda.empty_cache()
    return rows


def unfused_silu_mul_fp8(gate, up):
    """The torch sequence the fused kernel replaces (capturable: no host scalars)."""
    h = F.silu(gate) * up
    scale = h.abs().amax(-1, keepdim=True) / 448.0
    return (h / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale.float()


def bench_silu(bw: float, log) -> list:
    rows = []
    i = 9216
    for m in (64, 256):
        gu = torch.randn(m, 2 * i, dtype=torch.bfloat16, device="cuda") * 2
        gate, up = gu[:, :i], gu[:, i:]
        q, s = silu_mul_quant(gate, up)
        q_ref, s_ref = silu_mul_quant_ref(gate, up)
        codes = float((q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean())
        err = rel(q.double() * s.double(), F.silu(gate.double()) * up.double())
        if codes < 0.999 or err > 4e-2:
            raise SystemExit(f"silu_mul_quant wrong at M={m}: codes equal {codes:.4f}, rel err {err:.2e}")
        ours = graph_time_us([lambda: silu_mul_quant(gate, up)] * 8)
        ref = graph_time_us([lambda: unfused_silu_mul_fp8(gate, up)] * 8)
        nbytes = m * i * 2 * 2 + m * i + m * 4
        rows.append({"m": m, "i": i, "ours_us": round(ours, 2), "torch_us": round(ref, 2),
                     "speedup": round(ref / ours, 2), "codes_equal": codes, "%bw": round(100 * nbytes / (ours * 1e-6) / bw, 1)})
        log(f"silu_mul_quant M={m}: ours {ours:.1f}us, unfused torch {ref:.1f}us -> {ref / ours:.2f}x "
            f"({rows[-1]['%bw']}% bw, codes equal {codes:.4%})")
    return rows


def bench_gate_up_silu(bw: float, log) -> dict:
    """Batch 1, NVFP4 MLP input side on the 4B shape (gate_up 18432 x 2560): gemv_nvfp4 then
    silu_mul_quant (bf16 + pairs), against gemv_nvfp4_silu (one launch), both with PDL in a
    graph; checked equal bit for bit."""
    i, k = 9216, 2560
    w = torch.randn(2 * i, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    packed, scales, gs = nvfp4.quantize_weight(w)
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    xp = nvfp4_x_pairs(x)
    plain, inter = pack_m1(packed, scales), pack_m1(packed, scales, interleave=True)
    tile = m1_tile("nvfp4_silu", 2 * i, k)

    def two():
        gu = gemv_nvfp4(x, packed, scales, gs, x_pairs=xp, m1=plain, split_k=1, **tile)
        return silu_mul_quant(gu[:, :i], gu[:, i:], "bf16", pairs=True)[1]

    def one():
        return gemv_nvfp4_silu(xp, inter, gs, **tile)

    (aw, as_), (bw_, bs) = two(), one()
    if not (torch.equal(aw, bw_) and torch.equal(as_, bs)):
        raise SystemExit("gemv_nvfp4_silu differs from gemv_nvfp4 + silu_mul_quant")
    t2, t1 = graph_time_us([two] * 8), graph_time_us([one] * 8)
    nbytes = 2 * i * k // 2 + 2 * i * k // 16
    row = {"n": 2 * i, "k": k, "two_launch_us": round(t2, 2), "fused_us": round(t1, 2), "speedup": round(t2 / t1, 2),
           "fused %bw": round(100 * nbytes / (t1 * 1e-6) / bw, 1), "tile": tile}
    log(f"gate_up + silu (NVFP4, M=1): two launches {t2:.1f}us, fused {t1:.1f}us -> {t2 / t1:.2f}x "
        f"({row['fused %bw']}% bw)")
    return row


def transformers_glue_step(qkv, z, a, b, conv_state, conv_w, A_log, dt_bias, norm, state_kv, H, K, V):
    """transformers' Qwen3.5 GDN decode path between the projections, with fla-core's kernel."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update

    bsz = qkv.shape[0]
    hv = A_log.shape[0]
    x = causal_conv1d_update(qkv[:, :, None], conv_state, conv_w, None, "silu")[:, :, 0]
    q, k, v = torch.split(x, [H * K, H * K, hv * V], dim=-1)
    q, k, v = q.reshape(bsz, 1, H, K), k.reshape(bsz, 1, H, K), v.reshape(bsz, 1, hv, V)
    beta = b.sigmoid()[:, None]
    g = (-A_log.float().exp() * F.softplus(a.float() + dt_bias))[:, None]
    q, k = q.repeat_interleave(hv // H, dim=2), k.repeat_interleave(hv // H, dim=2)
    o, new_state = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state_kv,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    state_kv.copy_(new_state)
    return norm(o.reshape(-1, V), z.reshape(-1, V)).reshape(bsz, -1)


def bench_gdn(bw: float, log) -> list:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    H, HV, K, V = 16, 32, 128, 128
    C = 2 * H * K + HV * V
    rows = []
    for bsz in (1, 32, 64):
        slots_n = bsz + 1
        g = torch.Generator(device="cuda").manual_seed(bsz)

        def r(*shape, scale=1.0, dtype=torch.bfloat16):
            return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

        inp = dict(qkv=r(bsz, C), z=r(bsz, HV * V), a=r(bsz, HV), b=r(bsz, HV), conv_state=r(slots_n, C, 3),
                   conv_weight=r(C, 4, scale=0.5), A_log=r(HV, scale=0.5, dtype=torch.float32),
                   dt_bias=r(HV, dtype=torch.float32), norm_weight=r(V, scale=0.3) + 1,
                   state=r(slots_n, HV, V, K, scale=0.2, dtype=torch.float32))
        slots = torch.randperm(slots_n, device="cuda")[:bsz].int()
        out_ref, cs_ref, st_ref = gdn_decode_ref(**inp, slots=slots, num_k_heads=H, head_k_dim=K, head_v_dim=V)
        for nvb in (None, 1, 2, 4, 8):  # the default, then every V-split the sweep below times
            fresh = dict(inp, state=inp["state"].clone(), conv_state=inp["conv_state"].clone())
            out = torch.full((bsz, HV * V), float("nan"), dtype=torch.float32, device="cuda")
            gdn_decode(**fresh, slots=slots, num_k_heads=H, head_k_dim=K, head_v_dim=V, out=out, v_blocks=nvb)
            e_out, e_state = rel(out, out_ref), rel(fresh["state"], st_ref)
            if not (e_out <= 1e-3 and e_state <= 1e-3 and torch.equal(fresh["conv_state"], cs_ref)):
                raise SystemExit(f"gdn_decode wrong at B={bsz}, V-blocks {nvb}: out {e_out:.2e}, state {e_state:.2e}")
        out_bf = torch.empty(bsz, HV * V, dtype=torch.bfloat16, device="cuda")
        res = {}
        for nvb in (1, 2, 4, 8):
            for nw in (4, 8, 16):
                res[nvb, nw] = graph_time_us([lambda nw=nw, nvb=nvb: gdn_decode(
                    **inp, slots=slots, num_k_heads=H, head_k_dim=K, head_v_dim=V, out=out_bf, num_warps=nw,
                    v_blocks=nvb)] * 8)
        default = graph_time_us([lambda: gdn_decode(**inp, slots=slots, num_k_heads=H, head_k_dim=K, head_v_dim=V,
                                                    out=out_bf)] * 8)
        (nvb, nw) = min(res, key=res.get)
        ours = res[nvb, nw]
        log("  " + ", ".join(f"{b}x{w}: {t:.1f}" for (b, w), t in sorted(res.items())) + f"; default {default:.1f}")
        norm = Qwen3_5RMSNormGated(V).cuda().to(torch.bfloat16)
        norm.weight.data.copy_(inp["norm_weight"])
        state_kv = inp["state"][:bsz].transpose(-1, -2).contiguous()  # fla/transformers keep [.., K, V]
        conv_tf = inp["conv_state"][:bsz].clone()
        args = (inp["qkv"], inp["z"], inp["a"], inp["b"], conv_tf, inp["conv_weight"], inp["A_log"], inp["dt_bias"],
                norm, state_kv, H, K, V)
        try:
            base = graph_time_us([lambda: transformers_glue_step(*args)] * 8)
            base_kind = "graph"
        except Exception as e:  # noqa: BLE001 - the glue may not capture; time it eagerly then
            log(f"  baseline did not capture ({type(e).__name__}); timing eagerly")
            for _ in range(3):
                transformers_glue_step(*args)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                transformers_glue_step(*args)
            torch.cuda.synchronize()
            base, base_kind = (time.perf_counter() - t0) / 50 * 1e6, "eager"
        fla_only = None
        try:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
            q = torch.randn(bsz, 1, HV, K, device="cuda", dtype=torch.bfloat16)
            fla_only = graph_time_us([lambda: fused_recurrent_gated_delta_rule(
                q, q, q, g=torch.zeros(bsz, 1, HV, device="cuda"), beta=torch.ones(bsz, 1, HV, device="cuda",
                                                                                   dtype=torch.bfloat16),
                initial_state=state_kv, output_final_state=True, use_qk_l2norm_in_kernel=True)] * 8)
        except Exception as e:  # noqa: BLE001
            log(f"  fla kernel alone not timed: {e}")
        state_bytes = 2 * bsz * HV * V * K * 4
        roof_us = state_bytes / bw * 1e6
        rows.append({"batch": bsz, "ours_us": round(ours, 2), "num_warps": nw, "v_blocks": nvb,
                     "default_us": round(default, 2), "sweep_us": {f"{b}x{w}": round(t, 2) for (b, w), t in res.items()}, "fla_glue_us": round(base, 2),
                     "fla_glue_timing": base_kind, "fla_kernel_only_us": None if fla_only is None else round(fla_only, 2),
                     "speedup": round(base / ours, 2), "state_roofline_us": round(roof_us, 2),
                     "%roofline": round(100 * roof_us / ours, 1), "err_out": e_out, "err_state": e_state})
        log(f"gdn_decode B={bsz}: ours {ours:.1f}us (V-blocks {nvb}, warps {nw}), fla+glue {base:.1f}us ({base_kind}), fla kernel "
            f"{fla_only if fla_only is None else round(fla_only, 1)}us -> {base / ours:.2f}x; state roofline "
            f"{roof_us:.1f}us = {rows[-1]['%roofline']}%")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_kernels.json"))
    ap.add_argument("--table", type=Path, default=Path("latency_h200.json"))
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--only", default="gemv,silu,gdn",
                    help="comma-separated: gemv (kernels against baselines, tiles swept), silu, gdn, "
                         "table (the latency table of what the runtime launches, written to --table), "
                         "floor (the fastest read of each shape's bytes beside the runtime's GEMVs), "
                         "fp8 (FP8 GEMV tiles at each batch, the tensor-core form's swept above batch 1), "
                         "m1 (FP8 and NVFP4 batch-1 tiles, swept on the N = 2560 and K = 2560 shapes), "
                         "rules (floor's GEMVs alone: the runtime's tiles in long graphs, no sweep), "
                         "floorx (the floor at batch 1 on the N = 2560 shapes, also with an activation read "
                         "after the wait)")
    ap.add_argument("--pdl", default="0,1,2",
                    help="floor / floorx: the stream_read PDL orders swept (0 off, 1 the next launch after the "
                         "wait, 2 before it)")
    ap.add_argument("--shapes", default="all", choices=("all", "fused"),
                    help="GEMV shapes for --only gemv: the fused units and their members, or fused only")
    args = ap.parse_args()
    torch.manual_seed(0)
    only = set(args.only.split(","))
    modes = tuple(int(v) for v in args.pdl.split(","))

    def log(msg):
        print(msg, flush=True)

    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth(torch.device("cuda"))
    log(f"{gpu}: device copy {bw / 1e12:.2f} TB/s")
    result = {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "copy_tb_s": round(bw / 1e12, 3)}
    result["triton"] = triton.__version__
    if "silu" in only:
        result["silu_mul_quant"] = bench_silu(bw, log)
        result["gate_up_silu_m1"] = bench_gate_up_silu(bw, log)
    if "gdn" in only:
        result["gdn_decode"] = bench_gdn(bw, log)
    if "gemv" in only:
        ms = [int(v) for v in args.batches.split(",")]
        rows = bench_gemv({**FUSED, **MEMBERS} if args.shapes == "all" else FUSED, ms, bw, log)
        result["gemv"] = rows
    if "fp8" in only:
        result["fp8_tiles"] = bench_fp8_tiles(FUSED, [int(v) for v in args.batches.split(",")], bw, log)
    if "floor" in only:
        result["floor"] = bench_floor(FUSED, [int(v) for v in args.batches.split(",")], bw, log, pdl_modes=modes)
    if "floorx" in only:  # the N = 2560 shapes at batch 1: an activation K-step (2048 fp16) read after the wait
        result["floorx"] = bench_floor({kk: v for kk, v in FUSED.items() if v[0] == 2560}, [1], bw, log, x_words=1024,
                                       pdl_modes=modes)
    if "m1" in only:  # batch-1 tiles of both quantized formats, swept on the N = 2560 and K = 2560 shapes
        result["m1_tiles"] = bench_m1_tiles(FUSED, bw, log)
    if "rules" in only:
        result["rules"] = bench_floor(FUSED, [int(v) for v in args.batches.split(",")], bw, log, sweep=False)
    if "table" in only:  # the fused units and their members: search looks both up
        table = runtime_table({**FUSED, **MEMBERS}, [int(v) for v in args.batches.split(",")], log)
        result["table"] = table
        args.table.write_text(json.dumps({"gpu": gpu, "date": result["date"], "copy_tb_s": result["copy_tb_s"],
                                          "source": "scripts/bench_kernels.py --only table (what the runtime "
                                                    "launches)", "entries": table}, indent=1))
    args.out.write_text(json.dumps(result, indent=1))
    log(f"wrote {args.out}" + (f" and {args.table}" if "table" in only else ""))


if __name__ == "__main__":
    main()
