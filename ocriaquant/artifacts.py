"""What the verbs hand one another: the calibration artifact, the plan, and the fingerprints
that tie both to a model and pages. Verbs read and write them through this module, never
through each other (calibrate writes what search reads; search writes what export reads).

Calibration artifact, a directory:
  meta.json           fingerprint (model files, pages, settings), model and page folders (relative to
                      the artifact's folder, the bundled ones by name), groups
  sensitivity.json    {target: {group: {format: expected KL increase, nats per target token}}}
  stats.safetensors   per quantizable Linear: act_absmax, act_meansq, fisher, tokens

Plan, one json file: target, group -> format, the calibration and model it was searched on,
and the predicted and measured numbers that chose it. Its paths are written relative to the
plan's own folder (the bundled model by name), so a plan moved together with the model and
calibration it names still finds them; moved alone, `export --model DIR` takes any copy of the
model, checked by the model fingerprint the plan keeps. A calibration artifact keeps its model
and page folders the same way, relative to itself (`_folder_entry` / `_folder_from` for both).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .data import BUNDLED_PAGES
from .errors import OcriaError
from .files import replace_dir, temp_sibling, write_json_atomic
from .model.groups import FORMATS, LayerGroup
from .model.load import DEFAULT_MODEL, resolve_model_dir
from .quant.simulate import TARGETS

if TYPE_CHECKING:
    from .data import Page

DEFAULT_CALIBRATION = Path("ocriaquant-out") / "calib"
DEFAULT_SEARCH = Path("ocriaquant-out") / "search"

CALIBRATION_VERSION = 1  # bump when the artifact's contents change meaning: older ones are then recomputed
META, SENSITIVITY, STATS = "meta.json", "sensitivity.json", "stats.safetensors"
# meta.json's key, and value, saying its folders are relative to the artifact; artifacts written before
# it kept them as typed (absolute, or relative to the working directory of the run), and still read so.
RELATIVE_TO = ("relative_to", "artifact")


# ---------------------------------------------------------------------------- fingerprints

def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def model_fingerprint(model_dir: str | Path) -> str:
    """Hash of a model directory's config and weight files (names and contents)."""
    if not Path(model_dir).is_dir():
        raise OcriaError(f"{model_dir}: not a model directory")
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).iterdir()):
        if f.suffix in (".json", ".safetensors") and f.is_file():
            h.update(f.name.encode())
            h.update(_sha256_file(f).encode())
    return h.hexdigest()[:32]


def page_hash(page: Page) -> str:
    h = hashlib.sha256(page.image.tobytes())
    h.update(f"{page.image.size}|{page.prompt}|{page.reference}".encode())
    return h.hexdigest()[:16]


def calibration_fingerprint(model_dir: Path, pages: list[Page], settings: dict) -> dict:
    """What a calibration depends on: equal fingerprints mean an artifact can be reused."""
    return {"version": CALIBRATION_VERSION, "model": model_fingerprint(model_dir),
            "pages": [[p.name, page_hash(p)] for p in pages], "settings": settings}


# ---------------------------------------------------------------------------- calibration artifact

@dataclass(frozen=True, eq=False)
class Calibration:
    """A loaded calibration artifact; unpacks as (meta, sensitivity, stats)."""

    meta: dict
    sensitivity: dict[str, dict[str, dict[str, float]]]
    stats: dict[str, torch.Tensor]
    path: Path | None = None  # the artifact's folder: its meta's relative folders are relative to it

    def __iter__(self):
        return iter((self.meta, self.sensitivity, self.stats))

    @property
    def _base(self) -> Path | None:
        """The folder the meta's relative paths start from: None (the working directory) for an
        artifact written before they were relative to it."""
        key, value = RELATIVE_TO
        return self.path if self.path is not None and self.meta.get(key) == value else None

    @property
    def model_dir(self) -> Path:
        return _folder_from(self.meta, self._base, bundled=DEFAULT_MODEL, key="model_dir", by_name="model")

    @property
    def pages_dir(self) -> Path:
        return _folder_from(self.meta, self._base, bundled=BUNDLED_PAGES, key="pages_dir", by_name="page_set")

    @property
    def model_fingerprint(self) -> str:
        return self.meta["fingerprint"]["model"]


def is_calibration(path: str | Path) -> bool:
    return (Path(path) / META).exists()


def stored_fingerprint(path: str | Path) -> dict | None:
    """The fingerprint of the artifact at `path`: None where there is none yet or it cannot be
    read (a new calibration replaces it). A directory that is not an artifact is an error:
    calibration never replaces what it did not write."""
    path = Path(path)
    if not path.exists():
        return None
    if not (path / META).exists() or not (path / SENSITIVITY).exists():
        raise OcriaError(f"{path}: exists and is not a calibration artifact; choose another --out")
    try:
        return json.loads((path / META).read_text()).get("fingerprint")
    except (json.JSONDecodeError, AttributeError):
        return None


def write_calibration(out: str | Path, meta: dict, sensitivity: dict, stats: dict[str, torch.Tensor], *,
                      model_dir: str | Path, pages_dir: str | Path) -> None:
    """Write the artifact to a temporary sibling and rename it into place (replacing an older one).
    `meta` gets the model and page folders, relative to `out` (the bundled ones by name), so the
    artifact moved or copied together with them still finds them."""
    from safetensors.torch import save_file

    out = Path(out)
    meta = {**meta, RELATIVE_TO[0]: RELATIVE_TO[1],
            **_folder_entry(model_dir, out, bundled=DEFAULT_MODEL, key="model_dir", by_name="model"),
            **_folder_entry(pages_dir, out, bundled=BUNDLED_PAGES, key="pages_dir", by_name="page_set")}
    tmp = temp_sibling(out)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in stats.items()}, str(tmp / STATS))
    (tmp / SENSITIVITY).write_text(json.dumps(sensitivity, indent=1))
    (tmp / META).write_text(json.dumps(meta, indent=1))
    replace_dir(tmp, out)


def load_calibration(path: str | Path) -> Calibration:
    """(meta, sensitivity, stats) of an artifact, with an error that names what is missing."""
    from safetensors.torch import load_file

    path = Path(path)
    if not is_calibration(path):
        raise OcriaError(f"{path}: not a calibration artifact (no {META}); run `ocriaquant calibrate` first")
    for name in (SENSITIVITY, STATS):
        if not (path / name).exists():
            raise OcriaError(f"{path}: incomplete calibration artifact (no {name}); run `ocriaquant calibrate` again")
    try:
        meta = json.loads((path / META).read_text())
        sens = json.loads((path / SENSITIVITY).read_text())
    except json.JSONDecodeError as e:
        raise OcriaError(f"{path}: unreadable calibration artifact ({e}); run `ocriaquant calibrate` again") from e
    if not (isinstance(meta, dict) and "model" in (meta.get("fingerprint") or {})
            and ("model_dir" in meta or meta.get("model") == "bundled")
            and ("pages_dir" in meta or meta.get("page_set") == "bundled")
            and isinstance(sens, dict) and set(TARGETS) <= sens.keys()):
        raise OcriaError(f"{path}: calibration artifact lacks the model fingerprint, its folders or a target's "
                         "sensitivities; run `ocriaquant calibrate` again")
    return Calibration(meta, sens, load_file(str(path / STATS)), path)


def calibrated_model(calib: Calibration, path: str | Path) -> Path:
    """The model directory `calib` was made from, checked unchanged since."""
    if not calib.model_dir.is_dir():
        raise OcriaError(f"{path}: its model {calib.model_dir} is not there; keep the model where it was relative "
                         "to the artifact (move or copy them together), or calibrate again")
    if model_fingerprint(calib.model_dir) != calib.model_fingerprint:
        raise OcriaError(f"{calib.model_dir}: the model changed since {path} was calibrated; calibrate again")
    return calib.model_dir


def input_absmax(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per Linear, the largest |input| seen in calibration: the static W4A4 input global scale."""
    suffix = ".act_absmax"
    return {k[: -len(suffix)]: v.max() for k, v in stats.items() if k.endswith(suffix)}


# ---------------------------------------------------------------------------- plan

@dataclass(frozen=True)
class Plan:
    groups: dict[str, str]                  # layer group -> bf16 / fp8 / nvfp4
    target: str = "h200"                    # numerics it was judged in: h200 (NVFP4 W4A16) or b200 (W4A4)
    model_dir: Path | None = None
    calibration: Path | None = None         # the artifact it was searched on
    model_fingerprint: str | None = None    # of the model that artifact was calibrated on
    evidence: dict = field(default_factory=dict)  # search's numbers: batch, predicted, measured, tolerance
    path: Path | None = field(default=None, compare=False)  # the file it was read from, for messages

    @property
    def source(self) -> str:
        return str(self.path) if self.path else "plan"

    def to_json(self, base: str | Path | None = None) -> dict:
        """The plan as json, its paths relative to the folder `base` (default: the folder of the
        file it was read from, so it reads back as written; absolute for a plan never saved); the
        bundled model as `"model": "bundled"`, wherever this install keeps it."""
        if base is None and self.path is not None:
            base = Path(self.path).parent
        doc = {"target": self.target, **self.evidence, "groups": self.groups}
        calib = {}
        if self.calibration:
            calib["path"] = _portable(self.calibration, base)
        if self.model_fingerprint:
            calib["fingerprint"] = str(self.model_fingerprint)
        if calib:
            doc["calibration"] = calib
        doc.update(_folder_entry(self.model_dir, base, bundled=DEFAULT_MODEL, key="model_dir", by_name="model"))
        return doc

    @classmethod
    def from_json(cls, doc: dict, path: Path | None = None) -> Plan:
        """A plan from its json; relative paths are relative to the folder of `path`, the file it
        was read from."""
        calib = doc.get("calibration") or {}
        base = Path(path).parent if path else None
        model_dir = _folder_from(doc, base, bundled=DEFAULT_MODEL, key="model_dir", by_name="model")
        known = ("target", "groups", "calibration", "model_dir", "model")
        return cls(groups=dict(doc["groups"]), target=doc.get("target", "h200"), model_dir=model_dir,
                   calibration=_located(calib.get("path"), base), model_fingerprint=calib.get("fingerprint"),
                   evidence={k: v for k, v in doc.items() if k not in known}, path=path)

    def check_model(self, model_dir: Path) -> None:
        """Refuse a model other than the one the plan was calibrated on, or one that is not there."""
        model_dir = Path(model_dir)
        if self.model_dir is not None and model_dir == self.model_dir and not model_dir.exists():
            fp = f" (fingerprint {self.model_fingerprint})" if self.model_fingerprint else ""
            raise OcriaError(f"{self.source}: its model {model_dir} is not here; pass --model DIR with a copy of "
                             f"the model it was calibrated on{fp}")
        resolve_model_dir(model_dir)
        if self.model_fingerprint and model_fingerprint(model_dir) != self.model_fingerprint:
            raise OcriaError(f"{model_dir}: does not match the model the plan was calibrated on "
                             f"(fingerprint {self.model_fingerprint}); export the model you calibrated, "
                             "or calibrate again")


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _portable(path: Path, base: str | Path | None) -> str:
    """`path` relative to the folder `base` (lexically, as `_located` undoes it), else absolute."""
    absolute = os.path.abspath(path)
    if base is None:
        return absolute
    try:
        return os.path.relpath(absolute, os.path.abspath(base))
    except ValueError:  # another drive (Windows)
        return absolute


def _located(text: str | None, base: Path | None) -> Path | None:
    if not text:
        return None
    path = Path(text)
    return Path(os.path.normpath(base / path)) if base is not None and not path.is_absolute() else path


def _folder_entry(path: Path | None, base: str | Path | None, *, bundled: Path, key: str, by_name: str) -> dict:
    """How a json document names a folder: `{by_name: "bundled"}` for the one this install bundles
    (wherever it keeps it), else `{key: its path relative to the folder base}` (`_portable`)."""
    if not path:
        return {}
    if _same_dir(path, bundled):
        return {by_name: "bundled"}
    return {key: _portable(path, base)}


def _folder_from(doc: dict, base: Path | None, *, bundled: Path, key: str, by_name: str) -> Path | None:
    """The folder `_folder_entry` wrote into `doc`, relative paths taken from `base`."""
    return bundled if doc.get(by_name) == "bundled" else _located(doc.get(key), base)


def save_plan(path: str | Path, plan: Plan) -> None:
    """Write the plan, its paths relative to its own folder."""
    write_json_atomic(Path(path), plan.to_json(base=Path(path).parent))


def load_plan(path: str | Path) -> Plan:
    """Read a plan and check what can be checked without the model (formats, target)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
        plan = Plan.from_json(doc, path)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise OcriaError(f"{path}: not a plan written by `ocriaquant search` ({e!r})") from e
    _check_formats(plan.groups, plan.target, plan.source)
    return plan


def _check_formats(plan: dict[str, str], target: str, source: str) -> None:
    for name, fmt in plan.items():
        if fmt not in FORMATS:
            raise OcriaError(f"{source} gives {name!r} the unknown format {fmt!r}; formats are {', '.join(FORMATS)}")
    if target not in TARGETS:
        raise OcriaError(f"{source} names the unknown target {target!r}; targets are {', '.join(TARGETS)}")


def check_plan(plan: dict[str, str], groups: list[LayerGroup], target: str, source: str | Path = "plan") -> None:
    """Refuse a plan this model cannot take, naming the offending groups and where the plan came from."""
    source = str(source)
    by_name = {g.name: g for g in groups}
    unknown = sorted(set(plan) - set(by_name))
    if unknown:
        raise OcriaError(f"{source} names unknown layer groups: {', '.join(unknown[:5])}"
                         f"{' …' if len(unknown) > 5 else ''} (this model's groups look like "
                         f"{groups[min(1, len(groups) - 1)].name!r}; see `ocriaquant info`)")
    _check_formats(plan, target, source)
    for name, fmt in plan.items():
        if fmt != "bf16" and by_name[name].always_bf16:
            raise OcriaError(f"{source} gives {name!r} {fmt}, but {by_name[name].kind} groups always stay BF16")
