"""Interleaved A/B of runtime knobs in one process: the model is built once, then the decode step
is timed under each variant in turn, round after round.

    python scripts/ab_step.py --shape qwen3.5-4b --plan mixed --batch 1 --rounds 3 \\
        --variant base \\
        --variant w16 kernels.add_rmsnorm.NORM_WARPS_B1=16 \\
        --variant c128 kernels.attn_decode.CHUNK=128 kernels.attn_decode.MERGE_WARPS=8 \\
        --variant down9 env:OCRIAQUANT_TILE_nvfp4_2560x9216=128,512,8,9 \\
        --variant nonorm skip:add_rmsnorm \\
        --out ab.json

A variant is a name and settings: `<module>.<NAME>=<value>` sets a constant of a module under
ocriaquant.runtime (the launchers read theirs at every launch), `env:<NAME>=<value>` an
environment variable (OCRIAQUANT_PDL, the tile overrides of kernels/tiles.py), and
`skip:<launcher>` (add_rmsnorm, qk_norm_rope, gdn_decode or attn_decode) times the step as if
that kernel cost nothing: each call site runs it once, in the warm-up before capture, and then
gets those outputs back with no launch. Its outputs go stale, so a skip variant only times: it
bounds what fusing the kernel away could buy. `code:<launcher>=<file>` runs the launcher of that
name from another copy of its module (e.g. `git show HEAD:ocriaquant/runtime/kernels/gdn_decode.py
> /tmp/old.py`, then `--variant old code:gdn_decode=/tmp/old.py --variant new`): a change to a
kernel against the code before it, in one process. Before each
variant is timed the captured CUDA graphs and the Linears' cached tiles are dropped, so
the step is re-captured with its settings; after it, every setting goes back.

`ocriaquant bench` spends ~40 s building the 4B and capturing its graphs for one figure, so on a
lent GPU a variant per bench run costs far more than its timing. Here a variant costs a capture
(and the first time, Triton compiling what it changed) plus `--steps` steps, and variants run
interleaved, so drift between them shows as spread across rounds rather than as a difference.
Each figure is bench.decode_speed (the engine's host loop), with the roofline fraction on the
copy bandwidth measured at the start, as `ocriaquant bench` reports it. Every round re-captures, so
a variant runs as a process's third or later capture: a setting whose first capture differs (PDL
trigger-first did, BENCHMARKS.md session 29) needs scripts/bench_captures.py, or a bench per setting.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from ocriaquant.bench import add_step_args, copy_bandwidth, decode_speed, step_bytes, step_runtime
from ocriaquant.errors import OcriaError


# The launchers a skip: setting can stand in for, each with the position of an argument that is its
# call site's own tensor (a layer's norm weight, A_log, KV cache): what tells the call sites apart.
SKIPPABLE = {"add_rmsnorm": 2, "qk_norm_rope": 3, "gdn_decode": 6, "attn_decode": 1}


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


def launcher_from(name: str, path: Path):
    """Launcher `name` of the module at `path`, loaded as a sibling of ocriaquant.runtime.kernels'
    own modules (so its relative imports resolve there)."""
    import importlib.util

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
    """'kernels.add_rmsnorm.NORM_WARPS_B1=16' -> ("attr", module, name, 16);
    'env:NAME=value' -> ("env", None, NAME, "value"); 'skip:gdn_decode' -> ("attr", the kernels
    package, "gdn_decode", its stand-in); 'code:gdn_decode=old.py' -> ("attr", the kernels
    package, "gdn_decode", old.py's gdn_decode)."""
    if text.startswith(("code:", "skip:")):  # a launcher of the kernels package, replaced
        kernels = importlib.import_module("ocriaquant.runtime.kernels")
        name, sep, path = text[5:].partition("=")
        if text.startswith("skip:"):
            if name not in SKIPPABLE:
                raise SystemExit(f"ab_step.py: {text!r}: skip: takes one of {', '.join(SKIPPABLE)}")
            return ("attr", kernels, name, skipped(getattr(kernels, name), SKIPPABLE[name]))
        if not sep or not callable(getattr(kernels, name, None)):
            raise SystemExit(f"ab_step.py: {text!r} is not code:<launcher>=<file>, a launcher of "
                             "ocriaquant.runtime.kernels (gdn_decode, add_rmsnorm, ...) and a file")
        return ("attr", kernels, name, launcher_from(name, Path(path)))
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"ab_step.py: setting {text!r} is not <module>.<NAME>=<value>, env:<NAME>=<value>, "
                         "skip:<launcher> or code:<launcher>=<file>")
    if key.startswith("env:"):
        return ("env", None, key[4:], value)
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


def apply(settings) -> list:
    """Set each setting; returns what undo() needs to put them back."""
    saved = []
    for kind, module, name, value in settings:
        if kind == "env":
            saved.append((kind, None, name, os.environ.get(name)))
            os.environ[name] = value
        else:
            saved.append((kind, module, name, getattr(module, name)))
            setattr(module, name, value)
    return saved


def undo(saved: list) -> None:
    for kind, module, name, value in reversed(saved):
        if kind == "attr":
            setattr(module, name, value)
        elif value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def forget_captures(rt, retired: list) -> None:
    """Drop the runtime's CUDA graphs (kept alive in `retired`: their memory belongs to the shared
    pool) and every Linear's cached tiles (batch 1 and the FP8 tensor-core ones), so the next step
    is captured under the current settings."""
    from ocriaquant.runtime.layers import QuantLinear

    retired.extend(rt._graphs.values())
    rt._graphs = {}
    rt._last = None
    for m in rt.modules():
        if isinstance(m, QuantLinear):
            m.forget_tiles()


def tile_names(rt) -> set[str]:
    """The tile overrides (kernels/tiles.py) the step just captured looked up, one per GEMV shape
    and kind: OCRIAQUANT_TILE_<kind>_<n>x<k>."""
    from ocriaquant.runtime.kernels.tiles import tile_override_name
    from ocriaquant.runtime.layers import QuantLinear

    return {tile_override_name(kind, m.out_features, m.in_features)
            for m in rt.modules() if isinstance(m, QuantLinear) for kind in m.tile_kinds()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(ap, steps=64)  # timed per variant and round
    ap.add_argument("--rounds", type=int, default=3, help="times every variant is timed, interleaved")
    ap.add_argument("--device", default="cuda", help="cuda; cpu (with --backend torch) only checks the script")
    ap.add_argument("--backend", default="triton", choices=("triton", "torch"))
    ap.add_argument("--variant", nargs="+", action="append", required=True, metavar=("NAME", "SETTING"),
                    help="a name, then its settings (none: the code as it is)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = ap.parse_args()
    names = [v[0] for v in args.variant]
    if len(set(names)) != len(names):
        sys.exit(f"ab_step.py: variant names must differ, got {names}")
    variants = {v[0]: [parse_setting(s) for s in v[1:]] for v in args.variant}
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("ab_step.py: no CUDA device here (--device cpu --backend torch only checks the script)")

    t0 = time.perf_counter()
    try:
        rt, vocab = step_runtime(args, args.device, args.backend)
    except OcriaError as e:
        sys.exit(f"ab_step.py: {e}")
    on_gpu = rt.device.type == "cuda"
    bw = copy_bandwidth(rt.device) if on_gpu else float("nan")
    total = step_bytes(rt, args.batch, args.context)["total"]
    figures: dict[str, list[float]] = {n: [] for n in variants}
    retired: list = []
    unmatched: dict[str, list[str]] = {}
    for r in range(args.rounds):
        for name, settings in variants.items():
            saved = apply(settings)
            try:
                forget_captures(rt, retired)
                # every run starts from the same length: the cache's contents do not change the timing
                ms = decode_speed(rt, args.batch, args.context, args.steps, vocab) * 1e3
                if r == 0:  # a tile override naming no GEMV of this model would time the base as the variant
                    looked_up = tile_names(rt)
                    unmatched[name] = [n for kind, _, n, _ in settings
                                       if kind == "env" and n.startswith("OCRIAQUANT_TILE_") and n not in looked_up]
                    if unmatched[name]:
                        print(f"warning: variant {name}: {', '.join(unmatched[name])} matched no GEMV of this "
                              f"model (its tiles: {', '.join(sorted(looked_up))})", flush=True)
            finally:
                undo(saved)
            figures[name].append(round(ms, 4))
            print(f"round {r + 1} {name}: {ms:.3f} ms/step", flush=True)
    rows = []
    for name, ms in figures.items():
        med = statistics.median(ms)
        rows.append({"variant": name, "settings": [" ".join(a) for a in args.variant if a[0] == name][0],
                     "ms_per_step": ms, "median_ms": round(med, 4), "unmatched_tiles": unmatched.get(name, []),
                     "roofline_frac": round(total / bw / (med * 1e-3), 4) if on_gpu else None})
    report = {"shape": args.shape, "plan": args.plan, "batch": args.batch, "context": args.context,
              "max_len": rt.max_len, "steps": args.steps, "rounds": args.rounds,
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
