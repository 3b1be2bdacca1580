"""Check and time ocriaquant's decode kernels at Qwen3.5-4B shapes beside their baselines, in one run.

    python benchmarks/bench_kernels.py --out bench_kernels.json
    python benchmarks/bench_kernels.py --only table --table ocriaquant/recipes/latency_h200.json
    python benchmarks/bench_kernels.py --only rules --tiles my_gpu.json

Each kernel family lives in its own module beside this one, over a shared harness
(kernels_harness.py: the shapes, CUDA-graph timing, weight copies rotated past L2):
- kernels_gemv.py: gemv_bf16 / gemv_fp8 / gemv_nvfp4 against cuBLAS BF16 (F.linear) and
  torch._scaled_mm (FP8, row-wise scales), M = 1…64, on the 4B's fused and member shapes, tiles
  swept (`--only gemv`); FP8 tiles (`--only fp8`): gemv_fp8's at each batch, the tensor-core
  form's swept above batch 1, beside the old form, cuBLAS BF16 and _scaled_mm; batch-1 tiles
  (`--only m1`): gemv_fp8's and gemv_nvfp4's on the N = 2560 shapes (M1_TILES_N2560) and the
  K = 2560 input projections (M1_TILES_K2560), beside the tile table's, in graphs of >= 64
  launches; and the latency table (`--only table`, below);
- kernels_floor.py: the floor (`--only floor`), the fastest plain read found of each GEMV
  shape's bytes under this harness. A read-only stream (`stream_read`, every program xor-reduces
  contiguous 16-byte words and writes one word), swept over grid size, warps, loads in flight
  and PDL, beside the runtime's FP8 / NVFP4 GEMVs on the same bytes, in graphs of >= 64 launches
  so that the replay's own start is spread thin. Where the best stream misses a % of the copy
  bandwidth, a GEMV that must read those bytes and compute too is not expected to reach it.
  `--only floorx` (batch 1, N = 2560 shapes): the floor of a read that must also wait for its
  input, reading an activation K-step from L2 after the PDL wait before its first reduction, as
  every GEMV must. `--only rules`: the floor's GEMVs alone, the runtime's FP8 / NVFP4 launches
  at the tile table's tiles in the same long graphs, without the stream sweep (a minute);
- kernels_gdn.py: gdn_decode against fla-core's fused_recurrent_gated_delta_rule plus the
  transformers glue around it (conv update, split, gates, head repeat, gated RMSNorm),
  B = 1, 32, 64 (`--only gdn`);
- kernels_gdn_verify.py: speculative decoding's GDN verify + commit (gdn_verify.py, designs "states" and
  "replay", and "replay" with each commit folded into the next verify) against fla-core's fused_recurrent / chunk gated delta rule plus the glue a serving stack adds
  (state gathers, conv, masked re-run for the accepted prefix, write-backs), k = 2, 4, 8, 16 (`--ks`) at
  `--batches`, the tiles swept at k = 4; ours alone where fla-core is not installed (`--only gdn_verify`);
- kernels_silu.py: silu_mul_quant against the unfused torch sequence, M = 64, 256, and the
  batch-1 NVFP4 gate_up with SiLU in its epilogue against the two launches it replaces
  (`--only silu`).

Every kernel is first checked against its float64 reference (runtime/kernels/reference.py) on
fresh random inputs with a NaN-poisoned output. Times are medians of CUDA-graph replays, each
replay cycling over enough weight copies that nothing is served from L2. Achieved bandwidth is
reported against the device-to-device copy bandwidth measured in the same run.

Tiles: the runtime's tile table (`--tiles FILE`; by default ocriaquant/recipes/tiles/h200.json, as the
runtime reads it) gives the tile every "rule" figure runs at. On another GPU, sweep with
`--only m1` and `--only fp8`, write the best tiles into a table of your own, check it with
`--only rules --tiles FILE` and in the decode step (ab_step.py's `tiles:FILE` variant).

The latency table (what `ocriaquant search --latency-table` reads) times, per shape, format and
batch, what the runtime's QuantLinear launches (`--only table`, no tile sweep, about a minute):
at batch 1 the GEMV kernels at the tile table's tiles, with PDL as the runtime launches them;
above batch 1 gemv_fp8 at its tile for FP8, gemv_nvfp4's tensor-core form where the table has
an nvfp4 tile for that batch, and cuBLAS on the BF16 (or dequantized NVFP4) weight otherwise. The sweep's best tiles (`--only gemv`) are what a tile table is tuned from, not what
runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

from kernels_floor import bench_floor
from kernels_gdn import bench_gdn
from kernels_gdn_verify import bench_gdn_verify
from kernels_gemv import bench_fp8_tiles, bench_gemv, bench_m1_tiles, runtime_table
from kernels_harness import FUSED, MEMBERS
from kernels_silu import bench_gate_up_silu, bench_silu
from ocriaquant.bench import copy_bandwidth
from ocriaquant.errors import OcriaError
from ocriaquant.runtime.tiles import TileTable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_kernels.json"))
    ap.add_argument("--table", type=Path, default=Path("latency_h200.json"))
    ap.add_argument("--tiles", type=Path, default=None,
                    help="the GEMV tile table the rule / runtime figures run at (default: the runtime's, "
                         "ocriaquant/recipes/tiles/h200.json)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--ks", default="2,4,8,16", help="gdn_verify: draft lengths k (k + 1 tokens a row)")
    ap.add_argument("--only", default="gemv,silu,gdn",
                    help="comma-separated: gemv (kernels against baselines, tiles swept), silu, gdn, "
                         "gdn_verify (speculative verify + commit against fla-core + glue), "
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
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (it times CUDA graphs)")
    try:
        tiles = TileTable.load(args.tiles) if args.tiles else TileTable.default()
    except OcriaError as e:
        sys.exit(f"bench_kernels.py: {e}")
    torch.manual_seed(0)
    only = set(args.only.split(","))
    modes = tuple(int(v) for v in args.pdl.split(","))
    ms = [int(v) for v in args.batches.split(",")]

    def log(msg):
        print(msg, flush=True)

    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth(torch.device("cuda"))
    log(f"{gpu}: device copy {bw / 1e12:.2f} TB/s; tiles {tiles.source}")
    result = {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "triton": triton.__version__, "copy_tb_s": round(bw / 1e12, 3), "tiles": tiles.source}
    if "silu" in only:
        result["silu_mul_quant"] = bench_silu(bw, log)
        result["gate_up_silu_m1"] = bench_gate_up_silu(bw, log, tiles)
    if "gdn" in only:
        result["gdn_decode"] = bench_gdn(bw, log)
    if "gdn_verify" in only:
        result["gdn_verify"] = bench_gdn_verify(bw, log, ms, [int(v) for v in args.ks.split(",")])
    if "gemv" in only:
        result["gemv"] = bench_gemv({**FUSED, **MEMBERS} if args.shapes == "all" else FUSED, ms, bw, log, tiles)
    if "fp8" in only:
        result["fp8_tiles"] = bench_fp8_tiles(FUSED, ms, bw, log, tiles)
    if "floor" in only:
        result["floor"] = bench_floor(FUSED, ms, bw, log, tiles, pdl_modes=modes)
    if "floorx" in only:  # the N = 2560 shapes at batch 1: an activation K-step (2048 fp16) read after the wait
        result["floorx"] = bench_floor({kk: v for kk, v in FUSED.items() if v[0] == 2560}, [1], bw, log, tiles,
                                       x_words=1024, pdl_modes=modes)
    if "m1" in only:  # batch-1 tiles of both quantized formats, swept on the N = 2560 and K = 2560 shapes
        result["m1_tiles"] = bench_m1_tiles(FUSED, bw, log, tiles)
    if "rules" in only:
        result["rules"] = bench_floor(FUSED, ms, bw, log, tiles, sweep=False)
    if "table" in only:  # the fused units and their members: search looks both up
        table = runtime_table({**FUSED, **MEMBERS}, ms, log, tiles)
        result["table"] = table
        args.table.write_text(json.dumps({"gpu": gpu, "date": result["date"], "copy_tb_s": result["copy_tb_s"],
                                          "source": "benchmarks/bench_kernels.py --only table (what the runtime "
                                                    f"launches, tiles {tiles.source})", "entries": table}, indent=1))
    args.out.write_text(json.dumps(result, indent=1))
    log(f"wrote {args.out}" + (f" and {args.table}" if "table" in only else ""))


if __name__ == "__main__":
    main()
