"""GEMV families of bench_kernels.py: the kernels against cuBLAS and _scaled_mm with tiles swept
(`--only gemv`), the latency table of what the runtime launches (`--only table`), FP8 tiles at each
batch (`--only fp8`) and batch-1 tiles on the N = 2560 and K = 2560 shapes (`--only m1`).
"""

from __future__ import annotations

import torch

from kernels_harness import checked_timer, cycled, graph_time_us, rel, time_tiles, weight_copies
from ocriaquant.quant import nvfp4
from ocriaquant.runtime.kernels.gemv_bf16 import gemv_bf16
from ocriaquant.runtime.kernels.gemv_fp8 import gemv_fp8, gemv_fp8_quantizing, quant_fp8_per_token
from ocriaquant.runtime.kernels.gemv_nvfp4 import gemv_nvfp4, nvfp4_x_pairs
from ocriaquant.runtime.kernels.reference import gemv_bf16_ref, gemv_fp8_ref, gemv_nvfp4_ref
from ocriaquant.runtime.kernels.splitk import geometry

# The shape whose FP8 GEMV quantizes its own input at batch 1 in the runtime (gdn_decode / attention
# hand it their output's absmax): the latency table times that form (tiles kind fp8_qx) there.
QUANTIZING = "gdn_out / attn_o"


def bench_gemv(shapes: dict, ms: list[int], bw: float, log, tiles) -> list:
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
            if m == 1:  # the fp32 CUDA-core FP8 path (gemv_m1), at its tile, for comparison
                fma = tiles.tile("bf16", n, k)  # the fp32 kernel takes the BF16 GEMV's tiles
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


def runtime_table(shapes: dict, ms: list[int], log, tiles) -> list:
    """Per (N, K, format, batch): µs of what the runtime's QuantLinear.forward_kernels launches at the
    TileTable `tiles`' tiles (see bench_kernels.py's docstring), each output checked against its float64
    reference first."""
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
                fp8_m1 = (lambda i: gemv_fp8_quantizing(x, amax, *WQ[i], out=outs[i], **tiles.tile("fp8_qx", n, k))) \
                    if name == QUANTIZING else \
                    (lambda i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i], x_half=half[0], **tiles.tile("fp8", n, k)))
                fns = {"bf16": lambda i: gemv_bf16(x, W[i], out=outs[i], **tiles.tile("bf16", n, k)),
                       "fp8": fp8_m1,
                       "nvfp4": lambda i: gemv_nvfp4(None, WP[i][0], WP[i][1], gs, out=outs[i], x_pairs=pairs,
                                                     m1=WP[i][2], **tiles.tile("nvfp4", n, k))}
            else:
                dot = tiles.find("nvfp4", n, k, m)  # the runtime's tensor-core NVFP4 where its table has a tile
                fns = {"bf16": lambda i: torch.mm(x, W[i].T, out=outs[i]),
                       "fp8": lambda i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i], **tiles.tile("fp8", n, k, m)),
                       "nvfp4": (lambda i: gemv_nvfp4(x, WP[i][0], WP[i][1], gs, out=outs[i], path="dot", **dot))
                       if dot else (lambda i: torch.mm(x, WN[i].T, out=outs[i]))}
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


# gemv_dot(swap=True) tiles above batch 1: (block_n, block_k, num_warps, num_stages)
DOT_TILES = ((32, 256, 4, 3), (32, 512, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (64, 512, 4, 3), (128, 128, 4, 3),
             (128, 128, 4, 4), (128, 256, 4, 3))
# Batch-1 (half2) tiles tried on the N = 2560 shapes, per format: (block_n, block_k, num_warps, split_k),
# those whose block_k divides K; among them whole-K rows (block_k = K's largest power-of-two part, unsplit:
# each CTA issues all its weight loads before its PDL wait, and no split-K reduction remains).
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
# ... and on the K = 2560 input projections (gdn_in 12288, mlp_up 18432): the 4-warp gate_up
# tile, the 8-warp wide ones, and splits of one K-tile each (every load before the PDL wait)
M1_TILES_K2560 = {
    "fp8": ((32, 512, 4, 1), (16, 512, 4, 1), (64, 512, 4, 1), (128, 256, 8, 1), (256, 128, 8, 1), (32, 256, 4, 1),
            (64, 256, 8, 1), (8, 512, 4, 5), (16, 512, 4, 5), (32, 512, 4, 5), (64, 512, 8, 5), (32, 512, 8, 1)),
    "nvfp4": ((32, 512, 4, 1), (16, 512, 4, 1), (64, 512, 4, 1), (32, 512, 8, 1), (128, 512, 8, 1), (16, 256, 4, 1),
              (32, 256, 4, 1), (64, 256, 4, 1), (64, 256, 8, 1), (8, 512, 4, 5), (16, 512, 4, 5), (32, 512, 4, 5),
              (32, 512, 8, 5), (16, 512, 2, 5), (8, 512, 2, 5), (32, 512, 2, 1)),
}


def m1_candidates(kind: str, n: int, k: int, tiles) -> list:
    """The rule tile of `kind` at (n, k) (the TileTable `tiles`' batch-1 tile), then M1_TILES_N2560[kind] on the
    N = 2560 shapes, M1_TILES_K2560[kind] on the K = 2560 input projections."""
    swept = M1_TILES_N2560[kind] if n == 2560 else M1_TILES_K2560[kind] if k == 2560 and n < 65536 else ()
    return [dict(tiles.tile(kind, n, k))] + [dict(block_n=a, block_k=b, num_warps=c, split_k=d) for a, b, c, d in swept
                                             if k % b == 0]


def bench_m1_tiles(shapes: dict, bw: float, log, tiles) -> list:
    """Batch-1 tiles of gemv_fp8 and gemv_nvfp4 (activations ready, as the runtime's producers hand
    them), each checked against float64 on a poisoned output and timed in graphs of >= 64 launches:
    the rule tile (the TileTable `tiles`'), and M1_TILES_N2560 / M1_TILES_K2560 (m1_candidates)."""
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
            tried = time_tiles(m1_candidates(fmt, n, k, tiles), fn, timed, pct, log)
            best = min(tried, key=lambda t: t["us"])
            rule = next(t for t in tried if t["rule"])
            rows.append({"shape": name, "n": n, "k": k, "format": fmt, "bytes": wbytes + io, "best": best,
                         "rule": rule, "tried": tried})
            log(f"{name:20s} {fmt:5s} M=1 rule {rule['us']:6.2f}us ({rule['pct']:5.1f}%)  best {best['us']:6.2f}us "
                f"({best['pct']:5.1f}%) {({kk: v for kk, v in best.items() if kk not in ('us', 'pct', 'rule')})}")
        del WQ, WP
        torch.cuda.empty_cache()
    return rows


def bench_fp8_tiles(shapes: dict, ms: list[int], bw: float, log, tiles) -> list:
    """FP8 GEMV tiles, each checked against float64 on a poisoned output, timed in graphs of >= 64
    launches: above batch 1 gemv_dot's swapped form over DOT_TILES (½, 1, 2, 4 × the auto split) beside
    the plain form at its old default (16 x 256, 4 warps, 4 stages), cuBLAS BF16 and _scaled_mm;
    the rule (the TileTable `tiles`' tile) at each batch; at batch 1, on the N = 2560 shapes, M1_TILES_N2560."""
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
                tried = time_tiles(m1_candidates("fp8", n, k, tiles),
                                   lambda i, c: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i], x_half=half[0], **c), timed,
                                   pct, log)
            else:
                base["plain dot"] = timed(lambda i: gemv_dot(x_q, WQ[i][0], x_s, WQ[i][1], out=outs[i], block_n=16,
                                                             block_k=256, num_warps=4, num_stages=4), "plain dot")
                # the lm_head: many row tiles and no split already; its two fastest in an earlier sweep
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
                base["rule"] = timed(lambda i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i], **tiles.tile("fp8", n, k, m)), "rule")
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
