"""Probe: how much of the batch-1 NVFP4 GEMV's time is its weight decode? The kernel timed as it is, then with
the decode replaced by cheaper sequences that give wrong sums (timing only), on the shapes #8 measures.

    python scripts/probe_nvfp4_decode.py --variant exact --out decode_exact.json
    python scripts/probe_nvfp4_decode.py --variant mask --out decode_mask.json   # a fresh process per variant
    ncu --clock-control none -k regex:gemv_nvfp4_m1 --section ComputeWorkloadAnalysis \
        python scripts/probe_nvfp4_decode.py --profile      # each tile's kernel, untimed

Why. On the wide-K shapes (2560×4096, 2560×9216) the kernel reaches 53–59 % of the copy bandwidth on an H100
where a plain read of the same bytes reaches far more (BENCHMARKS.md, sessions 22-23 and 37). Its sm_90 SASS
spends ~22 of ~50 instructions a 16-weight block on the decode (12 LOP3, 10 shifts: half2.M1_LAYOUT), on the
integer pipes, which issue half as fast as the fp32 ones; each CTA streams a few K-tiles only, so the
arithmetic after its last load arrives is the kernel's tail. If the kernel is bound by those instructions,
the cheaper variants run faster; if by memory or latency, they run no faster.

Variants (half2._NVFP4_BLOCK_PTX, the per-block sequence, replaced before the first compile; everything else,
loads and scales included, as it is):
- exact: the kernel as the runtime runs it, checked against the float64 reference;
- mask: each fp16 pair masked out of its word with one LOP3 (word & 0x8E008E00 + j, no shifts; the
  masks differ in a mantissa bit so that ptxas cannot merge them): 8 integer ops a block instead of 22,
  what a decoder with one op a pair would cost;
- none: the words multiplied as they are (no decode): the kernel with its decode removed.

`--maxnreg` caps each launch's registers (Triton's maxnreg; a comma list, each timed): -1 the most that keeps its grid
one wave (2560×4096 on 4 × 4096, 4 warps: 640 CTAs, 5 a SM up to 102 registers; down_proj on 8 × 1024, 2 warps,
split 3: 960 CTAs, 8 a SM up to 128). A cap also changes how ptxas schedules: without one it kept the 8 × 1024 tile
at 96 registers and issued most of the next K-tile's weight loads only after the current tile's activations had
arrived (Triton 3.6's sm_90 SASS, offline). `--sweep` times more tiles of the two wide-K shapes. Every row records
the registers and CTAs a SM of the kernel that ran.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402

from ocriaquant.bench import copy_bandwidth  # noqa: E402
from ocriaquant.runtime.kernels import half2, splitk  # noqa: E402
from ocriaquant.runtime.kernels.gemv_nvfp4 import gemv_nvfp4, gemv_nvfp4_ref, nvfp4_x_pairs  # noqa: E402
from ocriaquant.runtime.kernels.tiles import m1_tile  # noqa: E402

# the module: the package's gemv_nvfp4 is the function
gemv_nvfp4_module = importlib.import_module("ocriaquant.runtime.kernels.gemv_nvfp4")


def block_ptx(variant: str) -> str:
    """The per-block inline PTX of a variant ($0 the fp32 sum, $1 $2 the words, $3..$10 the activation pairs)."""
    if variant == "exact":
        return half2._NVFP4_BLOCK_PTX.value
    lines = ["{", ".reg .b32 p, acc;", ".reg .b16 l, h;", ".reg .f32 fl, fh;"]
    for w in range(2):
        for j in range(4):
            src = f"${1 + w}"
            if variant == "mask":
                lines.append(f"and.b32 p, {src}, {0x8E008E00 + j:#x};")  # a mask per pair, or ptxas merges them
                src = "p"
            x = f"${3 + 4 * w + j}"
            lines.append(f"mul.rn.f16x2 acc, {src}, {x};" if w == j == 0 else f"fma.rn.f16x2 acc, {src}, {x}, acc;")
    lines += ["mov.b32 {l, h}, acc;", "cvt.f32.f16 fl, l; cvt.f32.f16 fh, h; add.f32 $0, fl, fh;", "}"]
    return "\n".join(lines)


def one_wave_cap(ctas: int, warps: int, sms: int) -> int:
    """The most registers a thread (a multiple of 8, the allocation unit) that let `ctas` CTAs of `warps` warps
    all be resident at once on `sms` SMs, by splitk.ctas_per_sm's count."""
    return max(r for r in range(8, 256, 8) if splitk.ctas_per_sm(r, warps, 0) * sms >= ctas)


def capped_launch(cap: list, seen: list):
    """gemv_nvfp4's pdl_launch with maxnreg cap[0] in place of the tile's (-1: one_wave_cap of the launch; 0: none,
    the compiler's choice), noting each launch's compiled registers and CTAs a SM in `seen`."""
    launch = gemv_nvfp4_module.pdl_launch
    props = torch.cuda.get_device_properties(0)

    def wrapped(kernel, grid, pdl, rows, *args, **kwargs):
        ctas = math.prod(grid)
        maxnreg = cap[0]
        kwargs.pop("maxnreg", None)  # a tile override's cap: each row says which cap it ran under
        if maxnreg:
            kwargs["maxnreg"] = one_wave_cap(ctas, kwargs["num_warps"], props.multi_processor_count) \
                if maxnreg < 0 else maxnreg
        compiled = launch(kernel, grid, pdl, rows, *args, **kwargs)
        per_sm = splitk.ctas_per_sm(compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared)
        seen.append(dict(regs=compiled.n_regs, ctas=ctas, ctas_per_sm=per_sm, maxnreg=kwargs.get("maxnreg"),
                         one_wave=splitk.one_wave(compiled, ctas, torch.device("cuda", 0))))
        return compiled
    return wrapped


# The rule tile first, then the tiles session 36's sweep found fastest alone (block_n, block_k, warps, split)
SHAPES = {"gdn_in (qkv+z)": ((12288, 2560), ()),
          "gdn_out / attn_o": ((2560, 4096), ((8, 4096, 4, 1), (4, 4096, 2, 1))),
          "mlp_down": ((2560, 9216), ((32, 1024, 8, 3), (4, 1024, 2, 1)))}
SWEEP = {"gdn_out / attn_o": ((2560, 4096), ((8, 4096, 4, 1), (8, 4096, 8, 1), (16, 4096, 8, 1), (8, 2048, 4, 2))),
         "mlp_down": ((2560, 9216), ((16, 1024, 4, 3), (32, 1024, 8, 3), (16, 1024, 2, 3), (8, 1024, 4, 3)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=("exact", "mask", "none"), default="exact")
    ap.add_argument("--out", type=Path, default=Path("probe_nvfp4_decode.json"))
    ap.add_argument("--maxnreg", default="0",
                    help="registers a thread at most (Triton's maxnreg), a comma list, each timed: 0 the compiler's "
                         "choice, -1 the most that keeps each launch's grid one wave")
    ap.add_argument("--sweep", action="store_true", help="the wide-K shapes' SWEEP tiles instead of SHAPES'")
    ap.add_argument("--profile", action="store_true",
                    help="launch each tile twice, untimed, and stop: for ncu (-k regex:gemv_nvfp4_m1)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_nvfp4_decode: needs a CUDA GPU (it times the kernel)")
    half2._NVFP4_BLOCK_PTX = tl.constexpr(block_ptx(args.variant))  # before the kernel's first compile
    seen, cap = [], [0]
    caps = [int(v) for v in args.maxnreg.split(",")]
    gemv_nvfp4_module.pdl_launch = capped_launch(cap, seen)
    torch.manual_seed(0)
    bw = copy_bandwidth(torch.device("cuda"))
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: copy {bw / 1e12:.2f} TB/s; variant {args.variant}", flush=True)
    rows = []
    for name, ((n, k), extra) in (SWEEP if args.sweep else SHAPES).items():
        _, _, WP, gs = bk.weight_copies(n, k)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        pairs = nvfp4_x_pairs(x)
        outs = [torch.empty(1, n, dtype=torch.bfloat16, device="cuda") for _ in WP]
        nbytes = n * k // 2 + n * k // 16 + k * 2 + n * 2
        tiles = [m1_tile("nvfp4", n, k)] + [dict(block_n=a, block_k=b, num_warps=c, split_k=d) for a, b, c, d in extra]
        for i, (tile, c) in enumerate((t, c) for t in tiles for c in caps):
            cap[0] = c  # read by capped_launch

            def call(j, tile=tile):
                return gemv_nvfp4(None, WP[j][0], WP[j][1], gs, out=outs[j], x_pairs=pairs, m1=WP[j][2], **tile)
            outs[0].fill_(float("nan"))
            call(0)
            err = bk.rel(outs[0], gemv_nvfp4_ref(x, WP[0][0], WP[0][1], gs))
            if args.variant == "exact" and not (bool(torch.isfinite(outs[0]).all()) and err <= 1e-2):
                raise SystemExit(f"probe_nvfp4_decode: exact kernel wrong at {name} {tile}: rel err {err:.2e}")
            if args.profile:
                call(1)
                torch.cuda.synchronize()
                continue
            us = bk.graph_time_us(bk.cycled([lambda j=j: call(j) for j in range(len(WP))]))
            pct = round(100 * nbytes / (us * 1e-6) / bw, 1)
            rows.append(dict(shape=name, n=n, k=k, tile=tile, rule=i < len(caps), us=round(us, 2), pct=pct,
                             rel_err=err, **seen[-1]))
            print(f"{name:18s} {str(tile):62s} {us:6.2f} us {pct:5.1f} %  (rel err {err:.1e}; {seen[-1]})",
                  flush=True)
        WP = outs = None  # this shape's weight copies freed before the next
        torch.cuda.empty_cache()
    if args.profile:
        return
    args.out.write_text(json.dumps({"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "copy_tb_s": round(bw / 1e12, 3),
                                    "variant": args.variant, "maxnreg": caps, "sweep": args.sweep,
                                    "block_ptx": block_ptx(args.variant), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
