"""GEMV tiles as data: a table from (kernel kind, weight shape [n, k], batch) to the tile
arguments the launcher takes. The runtime reads ocriaquant/recipes/tiles/h200.json (shipped in
the package) unless given another file (`--tiles FILE`); a GPU other than the H200 gets its own
file, swept with benchmarks/bench_kernels.py.

Kinds: bf16, fp8, nvfp4 (a Linear's GEMV in its format), fp8_qx (the FP8 GEMV that quantizes
its own input at batch 1: gemv_fp8_quantizing), nvfp4_silu (a fused NVFP4 gate_up with
silu · mul in its epilogue: gemv_nvfp4_silu). Batch 1 everywhere; above it fp8 (gemv_fp8's
tensor-core path) and nvfp4 (gemv_nvfp4's, where it beats cuBLAS on the dequantized weight: a
shape and batch with no nvfp4 tile runs cuBLAS), each entry for a range of batches `"m": [lo, hi]`.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import OcriaError
from ..recipes import RECIPES

KINDS = ("bf16", "fp8", "fp8_qx", "nvfp4", "nvfp4_silu")
FIELDS = ("block_n", "block_k", "num_warps", "split_k", "num_stages")
MAX_BATCH = 64  # the GEMV kernels take M <= 64 (QuantLinear.uses_kernels)
DEFAULT_FILE = RECIPES / "tiles" / "h200.json"

# A shape missing from the table: tiles every launcher takes at any shape (16 × 256 does not fit
# gemv_nvfp4_silu, whose tiles are whole 32-row blocks), correct, not tuned.
GENERIC_M1 = {"block_n": 32, "block_k": 256}
GENERIC_DOT = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "split_k": 1}


class TileTable:
    """Tiles by (kind, n, k) and batch. `tile()` is what the layers call at launch: the table's
    entry, or the generic tile where it has none."""

    def __init__(self, entries: list[dict], source: str = "<memory>", gpu: str | None = None):
        self.source, self.gpu = source, gpu
        self._index: dict[tuple[str, int, int], list[tuple[int, int, dict]]] = {}
        for i, entry in enumerate(entries):
            key, lo, hi, tile = _parse(entry, lambda problem, i=i, e=entry: OcriaError(
                f"{source}: tile entry {i} {json.dumps(e)}: {problem}"))
            ranges = self._index.setdefault(key, [])
            clash = next((r for r in ranges if lo <= r[1] and r[0] <= hi), None)
            if clash is not None:
                raise OcriaError(f"{source}: tile entry {i} {json.dumps(entry)}: batches {lo}-{hi} overlap another "
                                 f"entry of {key[0]} {key[1]}x{key[2]} (batches {clash[0]}-{clash[1]})")
            ranges.append((lo, hi, tile))

    @classmethod
    def load(cls, path) -> "TileTable":
        """A table file: {"gpu": ..., "note": ..., "tiles": [entry, ...]}, each entry
        {"kind", "n", "k", ["m": [lo, hi]], "block_n", "block_k", [num_warps, split_k, num_stages]}."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise OcriaError(f"{path}: no such tile table") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise OcriaError(f"{path}: not a readable JSON tile table ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("tiles"), list):
            raise OcriaError(f'{path}: a tile table is a JSON object with a "tiles" list')
        return cls(data["tiles"], str(path), data.get("gpu"))

    @classmethod
    def default(cls) -> "TileTable":
        """ocriaquant/recipes/tiles/h200.json, read once per process."""
        global _DEFAULT
        if _DEFAULT is None:
            if not DEFAULT_FILE.is_file():
                raise OcriaError(f"the default tile table {DEFAULT_FILE} is missing (an install without the "
                                 "package's recipes/ data); pass a table with --tiles FILE")
            _DEFAULT = cls.load(DEFAULT_FILE)
        return _DEFAULT

    def find(self, kind: str, n: int, k: int, m: int = 1) -> dict | None:
        """The table's tile for this launch, or None."""
        for lo, hi, tile in self._index.get((kind, n, k), ()):
            if lo <= m <= hi:
                return tile
        return None

    def tile(self, kind: str, n: int, k: int, m: int = 1) -> dict:
        """Keyword arguments for the launcher: the table's tile, else the generic one."""
        found = self.find(kind, n, k, m)
        if found is not None:
            return found
        return GENERIC_M1 if m == 1 else GENERIC_DOT

    def __len__(self) -> int:
        return sum(len(r) for r in self._index.values())

    def __repr__(self) -> str:
        return f"TileTable({self.source!r}, {len(self)} tiles)"


_DEFAULT: TileTable | None = None


def _parse(entry, error) -> tuple[tuple[str, int, int], int, int, dict]:
    """((kind, n, k), lo, hi, tile) of one entry, or `error(problem)` raised."""
    if not isinstance(entry, dict):
        raise error("an entry is a JSON object")
    unknown = set(entry) - {"kind", "n", "k", "m", *FIELDS}
    if unknown:
        raise error(f"unknown field(s) {', '.join(sorted(unknown))}; fields: kind, n, k, m, {', '.join(FIELDS)}")
    kind = entry.get("kind")
    if kind not in KINDS:
        raise error(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    for f in ("n", "k", "block_n", "block_k"):
        if f not in entry:
            raise error(f"{f} is missing")

    def positive(f):
        v = entry[f]
        if type(v) is not int or v <= 0:
            raise error(f"{f} must be a positive integer, got {v!r}")
        return v

    n, k = positive("n"), positive("k")
    tile = {f: positive(f) for f in FIELDS if f in entry}
    for f in ("block_n", "block_k", "num_warps"):
        if f in tile and tile[f] & (tile[f] - 1):
            raise error(f"{f} must be a power of two, got {tile[f]}")
    if kind == "nvfp4_silu" and ("split_k" in tile or tile["block_n"] % 32):
        raise error("nvfp4_silu takes whole 32-row tiles (block_n a multiple of 32) and no split_k")
    m = entry.get("m", [1, 1])
    if isinstance(m, int) and not isinstance(m, bool):
        m = [m, m]
    if not (isinstance(m, list) and len(m) == 2 and all(type(v) is int for v in m) and 1 <= m[0] <= m[1] <= MAX_BATCH):
        raise error(f"m must be a batch range [lo, hi] within 1-{MAX_BATCH}, got {entry.get('m')!r}")
    if m[1] > 1 and kind not in ("fp8", "nvfp4"):
        raise error(f"only fp8 and nvfp4 have tiles above batch 1 (the others run cuBLAS there), got m {m}")
    if m[0] == 1 and m[1] > 1:
        raise error("batch 1 and the batches above it run different kernels: give them separate entries")
    return (kind, n, k), m[0], m[1], tile
