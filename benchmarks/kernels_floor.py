"""The floor of a GEMV's weight stream (bench_kernels.py `--only floor`, `floorx`, `rules`): a plain
read of the shape's bytes (stream_read, swept over grid, warps, loads in flight and PDL order) beside
the runtime's FP8 / NVFP4 GEMVs on the same bytes, in graphs of >= 64 launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_harness import copies_for, cycled, graph_time_us, rel, weight_copies
from ocriaquant.runtime.kernels.gemv_fp8 import gemv_fp8, quant_fp8_per_token
from ocriaquant.runtime.kernels.gemv_nvfp4 import gemv_nvfp4, nvfp4_x_pairs
from ocriaquant.runtime.kernels.reference import gemv_fp8_ref, gemv_nvfp4_ref
from ocriaquant.runtime.kernels.splitk import wait_for_inputs


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


def bench_floor(shapes: dict, ms: list[int], bw: float, log, tiles, sweep: bool = True, x_words: int = 0,
                pdl_modes: tuple = (0, 1, 2)) -> list:
    """Per shape: the fastest stream_read of its FP8 and NVFP4 weight bytes (copies rotated past
    L2, the best of stream_configs with and without PDL), beside the runtime's GEMVs on the
    same shape (QuantLinear's launches at the TileTable `tiles`' tile of each batch), all in
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
                    kw = dict(tiles.tile("fp8", n, k, m), **(dict(x_half=half[0]) if m == 1 else {}))
                    fns = [lambda i=i: gemv_fp8(x_q, x_s, *WQ[i], out=outs[i], **kw) for i in range(nc)]
                    outs[0].fill_(float("nan"))
                    fns[0]()
                    err = rel(outs[0], gemv_fp8_ref(x_q, x_s, *WQ[0]))
                else:
                    pairs = nvfp4_x_pairs(x)
                    fns = [lambda i=i: gemv_nvfp4(None, WP[i][0], WP[i][1], gs, out=outs[i], x_pairs=pairs, m1=WP[i][2],
                                                  **tiles.tile("nvfp4", n, k)) for i in range(nc)]
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
