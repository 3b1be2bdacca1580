"""Interleaved A/B of runtime knobs in one process: the model is built once, then the decode step
is timed under each variant in turn, round after round.

    python benchmarks/ab_step.py --shape qwen3.5-4b --plan mixed --batch 1 --rounds 3 \\
        --variant base \\
        --variant w8 kernels.add_rmsnorm.NORM_WARPS_B1=8 \\
        --variant c128 kernels.attn_decode.CHUNK=128 kernels.attn_decode.MERGE_WARPS=8 \\
        --variant down9 tiles:/tmp/down9.json \\
        --variant nopdl pdl:0 \\
        --variant nonorm skip:add_rmsnorm \\
        --out ab.json

A variant is a name and settings:
- `<module>.<NAME>=<value>` sets a constant of a module under ocriaquant.runtime (the launchers
  read theirs at every launch);
- `tiles:<file>` runs the step at another GEMV tile table (a JSON file in the format of
  ocriaquant/recipes/tiles/h200.json, read by ocriaquant.runtime.tiles.TileTable), as a runtime built with
  `--tiles <file>` would; the tool warns when that table gives this model's GEMVs at this batch
  the same tiles as the base's (`--tiles`, by default the runtime's own table);
- `pdl:0` / `pdl:1` launches the step's kernels without / with programmatic dependent launch
  (what OCRIAQUANT_PDL chooses when a runtime is built);
- `skip:<launcher>` (add_rmsnorm, qk_norm_rope, gdn_decode or attn_decode) times the step as if
  that kernel cost nothing: each call site runs it once, in the warm-up before capture, and then
  gets those outputs back with no launch. Its outputs go stale, so a skip variant only times: it
  bounds what fusing the kernel away could buy;
- `code:<launcher>=<file>` runs the launcher of that name from another copy of its module
  (e.g. `git show HEAD:ocriaquant/runtime/kernels/gdn_decode.py > /tmp/old.py`, then `--variant
  old code:gdn_decode=/tmp/old.py --variant new`): a change to a kernel against the code before
  it, in one process.
A launcher is replaced in its own module (ocriaquant.runtime.kernels.<launcher>), where the layers
import it from at every call. Before each variant is timed the captured CUDA graphs are dropped, so
the step is re-captured with its settings; after it, every setting goes back.

`ocriaquant bench` spends ~40 s building the 4B and capturing its graphs for one figure, so on a
lent GPU a variant per bench run costs far more than its timing. Here a variant costs a capture
(and the first time, Triton compiling what it changed) plus `--steps` steps, and variants run
interleaved, so drift between them shows as spread across rounds rather than as a difference.
Each figure is bench.decode_speed (the engine's host loop), with the roofline fraction on the
copy bandwidth measured at the start, as `ocriaquant bench` reports it. Every round re-captures, so
a variant runs as a process's third or later capture, while `ocriaquant bench` and the engine replay
a process's first: a setting whose first capture runs differently from later ones (this has been
seen, by ~1 % of a step) needs `ocriaquant bench` run once per setting to confirm.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from common import add_step_args, step_runtime
from ocriaquant.bench import copy_bandwidth, decode_speed, step_bytes
from ocriaquant.errors import OcriaError

# The launchers a skip: setting can stand in for, each with the position of an argument that is its
# call site's own tensor (a layer's norm weight, A_log, KV cache): what tells the call sites apart.
SKIPPABLE = {"add_rmsnorm": 2, "qk_norm_rope": 3, "gdn_decode": 6, "attn_decode": 1}
# The settings of the runner's kernel settings (config.Kernels, shared by every layer): tiles:, pdl:
RUNNER_SETTINGS = ("tiles", "pdl")


def skipped(real, site: int):
    """A stand-in for launcher `real`: the real launcher the first time a call site (its argument
    `site`, at a batch size) calls it, those same outputs, and no launch, every time after."""
    outputs = {}

    def stub(*args, **kwargs):
        key = (args[site].data_ptr(), args[0].shape[0])
        if key not in outputs:
            outputs[key] = real(*args, **kwargs)
        return outputs[key]
    return stub


def launcher_module(name: str):
    """ocriaquant.runtime.kernels.<name>, the module of launcher `name` (which the layers import it
    from at every call), or None when there is no such module or it defines no callable `name`."""
    try:
        module = importlib.import_module(f"ocriaquant.runtime.kernels.{name}")
    except ImportError:
        return None
    return module if callable(getattr(module, name, None)) else None


def launcher_from(name: str, path: Path):
    """Launcher `name` of the module at `path`, loaded as a sibling of ocriaquant.runtime.kernels'
    own modules (so its relative imports resolve there)."""
    if not path.is_file():
        raise SystemExit(f"ab_step.py: code:{name}={path}: no such file")
    spec = importlib.util.spec_from_file_location(f"ocriaquant.runtime.kernels._ab_{name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    launcher = getattr(module, name, None)
    if not callable(launcher):
        raise SystemExit(f"ab_step.py: code:{name}={path}: the file defines no {name}")
    return launcher


def parse_setting(text: str):
    """One setting, as (kind, target, name, value) for apply():
    'kernels.add_rmsnorm.NORM_WARPS_B1=16' -> ("attr", the module, "NORM_WARPS_B1", 16);
    'skip:gdn_decode' -> ("attr", kernels.gdn_decode's module, "gdn_decode", its stand-in);
    'code:gdn_decode=old.py' -> ("attr", kernels.gdn_decode's module, "gdn_decode", old.py's gdn_decode);
    'tiles:t.json' -> ("runner", None, "tiles", t.json's TileTable); 'pdl:0' -> ("runner", None, "pdl", False)."""
    if text.startswith(("code:", "skip:")):  # a launcher, replaced in its own module
        name, sep, path = text[5:].partition("=")
        if text.startswith("skip:"):
            if name not in SKIPPABLE or sep:
                raise SystemExit(f"ab_step.py: {text!r}: skip: takes one of {', '.join(SKIPPABLE)}")
            module = launcher_module(name)
            return ("attr", module, name, skipped(getattr(module, name), SKIPPABLE[name]))
        module = launcher_module(name) if name else None
        if not sep or module is None:
            raise SystemExit(f"ab_step.py: {text!r} is not code:<launcher>=<file>, a launcher of "
                             "ocriaquant.runtime.kernels (gdn_decode, add_rmsnorm, ...) and a file")
        return ("attr", module, name, launcher_from(name, Path(path)))
    if text.startswith("tiles:"):
        from ocriaquant.runtime.tiles import TileTable

        if not text[6:]:
            raise SystemExit(f"ab_step.py: {text!r} is not tiles:<file>")
        try:
            return ("runner", None, "tiles", TileTable.load(text[6:]))
        except OcriaError as e:
            raise SystemExit(f"ab_step.py: {text!r}: {e}") from e
    if text.startswith("pdl:"):
        if text[4:] not in ("0", "1"):
            raise SystemExit(f"ab_step.py: {text!r} is not pdl:0 or pdl:1")
        return ("runner", None, "pdl", text[4:] == "1")
    if text.startswith("env:"):
        raise SystemExit(f"ab_step.py: {text!r}: env: settings are gone (a runtime reads its settings once, when it "
                         "is built): tiles:<file> replaces OCRIAQUANT_TILE_*, pdl:0 OCRIAQUANT_PDL=0")
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"ab_step.py: setting {text!r} is not <module>.<NAME>=<value>, tiles:<file>, pdl:0|1, "
                         "skip:<launcher> or code:<launcher>=<file>")
    mod_name, _, attr = key.rpartition(".")
    try:
        module = importlib.import_module(f"ocriaquant.runtime.{mod_name}")
    except ImportError as e:
        raise SystemExit(f"ab_step.py: {text!r}: no module ocriaquant.runtime.{mod_name} ({e})") from e
    if not hasattr(module, attr):
        raise SystemExit(f"ab_step.py: {text!r}: ocriaquant.runtime.{mod_name} has no {attr}")
    old = getattr(module, attr)
    try:
        new = type(old)(value)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"ab_step.py: {text!r}: {attr} holds {type(old).__name__} values, got {value!r}") from e
    return ("attr", module, attr, new)


def apply(settings, runner=None) -> list:
    """Set each setting (tiles: and pdl: on `runner`'s kernel settings); returns what undo() needs to
    put them back."""
    saved = []
    for kind, target, name, value in settings:
        if kind == "runner":
            if runner is None or runner.kernels is None:
                undo(saved)
                raise SystemExit(f"ab_step.py: a {name}: setting needs a runtime on the triton backend")
            target = runner.kernels
        saved.append((target, name, getattr(target, name)))
        setattr(target, name, value)
    return saved


def undo(saved: list) -> None:
    for target, name, value in reversed(saved):
        setattr(target, name, value)


def forget_captures(runner, retired: list) -> None:
    """Drop the runner's CUDA graphs (kept alive in `retired`: their memory belongs to the shared
    pool), so the next step is captured under the current settings: a graph holds the tiles and
    launchers it was captured with."""
    retired.extend(runner._graphs.values())
    runner._graphs = {}
    runner._last = None


def tile_changes(runner, table, batch: int) -> list[str]:
    """The GEMVs of the runner's model whose tile at `batch` rows (as its CUDA graph pads them) differs
    between the table it was built with and `table`: "<kind> <n>x<k>: <tile> -> <tile>"."""
    from ocriaquant.runtime.model_runner import bucket_for

    base, m = runner.kernels.tiles, bucket_for(batch) or batch
    return [f"{kind} {n}x{k}: {base.tile(kind, n, k, m)} -> {table.tile(kind, n, k, m)}"
            for kind, n, k, km in sorted(runner.model.tile_keys())
            if km == m and base.tile(kind, n, k, m) != table.tile(kind, n, k, m)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(ap, steps=64)  # timed per variant and round
    ap.add_argument("--rounds", type=int, default=3, help="times every variant is timed, interleaved")
    ap.add_argument("--device", default="cuda", help="cuda; cpu (with --backend torch) only checks the tool")
    ap.add_argument("--backend", default="triton", choices=("triton", "torch"))
    ap.add_argument("--variant", nargs="+", action="append", required=True, metavar=("NAME", "SETTING"),
                    help="a name, then its settings (none: the code as it is)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = ap.parse_args()
    names = [v[0] for v in args.variant]
    if len(set(names)) != len(names):
        sys.exit(f"ab_step.py: variant names must differ, got {names}")
    variants = {v[0]: [parse_setting(s) for s in v[1:]] for v in args.variant}
    if args.backend != "triton" and any(kind == "runner" for settings in variants.values() for kind, *_ in settings):
        sys.exit("ab_step.py: tiles: and pdl: settings need --backend triton")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("ab_step.py: no CUDA device here (--device cpu --backend torch only checks the tool)")

    t0 = time.perf_counter()
    try:
        rt, vocab = step_runtime(args, args.device, args.backend)
    except OcriaError as e:
        sys.exit(f"ab_step.py: {e}")
    changed: dict[str, list[str] | None] = {}
    for name, settings in variants.items():
        tables = [value for kind, _, attr, value in settings if kind == "runner" and attr == "tiles"]
        if tables and rt.kernels is not None:
            changed[name] = tile_changes(rt, tables[-1], args.batch)
            if not changed[name]:  # the variant would time the base's tiles
                print(f"warning: variant {name}: its tile table gives every GEMV of this model at batch "
                      f"{args.batch} the tiles of {rt.tiles.source}", flush=True)
    on_gpu = rt.device.type == "cuda"
    bw = copy_bandwidth(rt.device) if on_gpu else float("nan")
    total = step_bytes(rt, args.batch, args.context)["total"]
    figures: dict[str, list[float]] = {n: [] for n in variants}
    retired: list = []
    for r in range(args.rounds):
        for name, settings in variants.items():
            saved = apply(settings, rt)
            try:
                forget_captures(rt, retired)
                # every run starts from the same length: the cache's contents do not change the timing
                ms = decode_speed(rt, args.batch, args.context, args.steps, vocab) * 1e3
            finally:
                undo(saved)
            figures[name].append(round(ms, 4))
            print(f"round {r + 1} {name}: {ms:.3f} ms/step", flush=True)
    rows = []
    for name, ms in figures.items():
        med = statistics.median(ms)
        rows.append({"variant": name, "settings": [" ".join(a) for a in args.variant if a[0] == name][0],
                     "ms_per_step": ms, "median_ms": round(med, 4), "tiles_changed": changed.get(name),
                     "roofline_frac": round(total / bw / (med * 1e-3), 4) if on_gpu else None})
    report = {"shape": args.shape, "plan": args.plan, "batch": args.batch, "context": args.context,
              "max_len": rt.max_len, "steps": args.steps, "rounds": args.rounds,
              "tiles": rt.tiles.source if rt.tiles is not None else None,
              "device": torch.cuda.get_device_name() if on_gpu else "cpu",
              "torch": torch.__version__, "copy_tb_s": round(bw / 1e12, 3) if on_gpu else None,
              "bytes_per_step": total, "variants": rows, "total_s": round(time.perf_counter() - t0, 1)}
    base = rows[0]["median_ms"]
    print(f"{args.shape} {args.plan} batch {args.batch} on {report['device']}, {args.rounds} rounds of {args.steps} "
          f"steps (median ms/step; against {rows[0]['variant']})")
    for row in rows:
        frac = f"{row['roofline_frac']:.1%}" if row["roofline_frac"] is not None else "-"
        print(f"  {row['variant']:>12} {row['median_ms']:8.3f} ms {row['median_ms'] - base:+8.3f}  {frac:>6}  "
              f"{' '.join(f'{m:.3f}' for m in row['ms_per_step'])}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
