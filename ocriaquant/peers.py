"""Published Qwen3.5 quantization recipes ("peers"), as data, mapped onto our layer groups.

`ocriaquant search` evaluates them beside its own candidates (same numerics, same held-out
pages, same cost model) so the report shows what the search buys over a hand-written recipe;
`ocriaquant export --recipe NAME` exports one as it stands. Not a verb: search imports it.

A recipe is a YAML file in ocriaquant/recipes/peers/ (or any path):

    name: llmcompressor-nvfp4          # how --peers and --recipe call it
    title: llmcompressor Qwen3.5 NVFP4 example
    source: https://...                # where the layout was published
    note: ...                          # optional: what the source says, in a line
    default: nvfp4                     # format of a group no rule decides
    rules:                             # first match wins
      - {kinds: [linear_attn], format: bf16}
      - {kinds: [mlp], layers: last 25%, format: fp8}

`kinds`: group kinds (gdn_in, gdn_ab, gdn_out, attn_qkv, attn_o, mlp_up, mlp_down, lm_head,
vision), the block names that stand for several (linear_attn = gdn_in + gdn_ab + gdn_out,
self_attn = attn_qkv + attn_o, mlp = mlp_up + mlp_down), or `mtp`, which is no layer group
(export carries mtp.* over untouched, in BF16). An unknown kind is an error that names it.
`layers` (optional; decoder-layer groups only): `first N`, `last N`, `first P%`, `last P%`
(rounded up), `A-B` (inclusive), an index or a list of indices.

A rule that decides no group of the model (its layers do not exist, its kind is absent, or
earlier rules took every group it matches) is reported with the mapping, never silently
dropped. gdn_ab and vision always stay BF16 in ocriaquant: `default` leaves them BF16, and a
rule that names them with another format is an error (the recipe cannot be exported as it
stands).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import yaml

from .errors import OcriaError
from .model.groups import ALWAYS_BF16_KINDS, FORMATS, GROUP_KINDS, LayerGroup
from .recipes import RECIPES

PEERS_DIR = RECIPES / "peers"
BLOCKS = {"linear_attn": ("gdn_in", "gdn_ab", "gdn_out"), "self_attn": ("attn_qkv", "attn_o"),
          "mlp": ("mlp_up", "mlp_down")}
NOT_GROUPS = {"mtp": "mtp.* is not a layer group; export carries it over untouched, in BF16"}
KINDS = tuple(GROUP_KINDS) + tuple(BLOCKS) + tuple(NOT_GROUPS)
_RULE_KEYS = {"kinds", "layers", "format"}
_RECIPE_KEYS = {"name", "title", "source", "note", "default", "rules"}


# ---------------------------------------------------------------------------- rules

@dataclass(frozen=True)
class Rule:
    kinds: tuple[str, ...]       # as written (block names unexpanded)
    format: str
    layers: str | None = None    # as written; None: every group of those kinds

    @property
    def group_kinds(self) -> set[str]:
        return {k for kind in self.kinds for k in BLOCKS.get(kind, (kind,))}

    def describe(self) -> str:
        where = f" in layers {self.layers}" if self.layers is not None else ""
        return f"{'+'.join(self.kinds)}{where} -> {self.format}"

    def layer_set(self, n_layers: int) -> set[int] | None:
        """Decoder-layer indices the rule covers in a model of `n_layers` (None: no restriction)."""
        return None if self.layers is None else parse_layers(self.layers, n_layers)

    def matches(self, group: LayerGroup, layers: set[int] | None) -> bool:
        if group.kind not in self.group_kinds:
            return False
        return layers is None or (group.layer is not None and group.layer in layers)


_SPAN = re.compile(r"^(first|last)\s+(\d+(?:\.\d+)?)\s*(%?)$")
_RANGE = re.compile(r"^(\d+)\s*-\s*(\d+)$")


def parse_layers(spec, n_layers: int) -> set[int]:
    """`first N`, `last N`, `first P%`, `last P%` (rounded up), `A-B` (inclusive), an index or
    a list of indices -> the set of decoder-layer indices (those past the model's end dropped)."""
    if isinstance(spec, bool):
        raise ValueError(f"bad layers {spec!r}")
    if isinstance(spec, int):
        return {spec} & set(range(n_layers))
    if isinstance(spec, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
            raise ValueError(f"bad layers {spec!r}: a list holds layer indices")
        return set(spec) & set(range(n_layers))
    text = str(spec).strip().lower()
    m = _SPAN.match(text)
    if m:
        side, amount, pct = m.groups()
        count = math.ceil(float(amount) * n_layers / 100 - 1e-9) if pct else int(float(amount))
        if not pct and float(amount) != int(float(amount)):
            raise ValueError(f"bad layers {spec!r}: a count of layers is a whole number")
        count = max(0, min(count, n_layers))
        return set(range(count)) if side == "first" else set(range(n_layers - count, n_layers))
    m = _RANGE.match(text)
    if m:
        a, b = int(m.group(1)), int(m.group(2))
        if a > b:
            raise ValueError(f"bad layers {spec!r}: range runs backwards")
        return set(range(a, b + 1)) & set(range(n_layers))
    if text.isdigit():
        return {int(text)} & set(range(n_layers))
    raise ValueError(f"bad layers {spec!r}: use 'first N', 'last N', 'first P%', 'last P%', 'A-B', "
                     "an index or a list of indices")


# ---------------------------------------------------------------------------- recipes

@dataclass(frozen=True)
class PeerRecipe:
    name: str
    title: str
    source: str
    default: str
    rules: tuple[Rule, ...]
    note: str = ""
    path: Path | None = field(default=None, compare=False)

    def map(self, groups: Sequence[LayerGroup]) -> "PeerPlan":
        """The recipe on a model's groups: group -> format, and what did not apply."""
        n_layers = 1 + max((g.layer for g in groups if g.layer is not None), default=-1)
        plan: dict[str, str] = {}
        decided = [0] * len(self.rules)
        matched = [0] * len(self.rules)
        spans = [r.layer_set(n_layers) for r in self.rules]
        for g in groups:
            fmt = None
            for i, (rule, span) in enumerate(zip(self.rules, spans)):
                if rule.matches(g, span):
                    matched[i] += 1
                    if fmt is None:
                        fmt, decided[i] = rule.format, decided[i] + 1
            plan[g.name] = "bf16" if g.always_bf16 else (fmt or self.default)
        notes = []
        for rule, n_dec, n_match, span in zip(self.rules, decided, matched, spans):
            if n_dec:
                continue
            extra = [NOT_GROUPS[k] for k in rule.kinds if k in NOT_GROUPS]
            if n_match:
                why = f"every group it matches ({n_match}) is decided by an earlier rule"
            elif extra and set(rule.kinds) <= set(NOT_GROUPS):
                why = "; ".join(extra) + ("" if rule.format == "bf16" else f", so {rule.format} cannot be applied")
            elif span is not None and not span:
                why = f"this model has {n_layers} decoder layers, none in {rule.layers!r}"
            else:
                why = "no group of this model has that kind"
            notes.append(f"rule `{rule.describe()}` decides no layer group of this model ({why})")
        return PeerPlan(self, plan, notes)

    def summary(self) -> dict:
        return {"name": self.name, "title": self.title, "source": self.source, "note": self.note,
                "default": self.default, "rules": [r.describe() for r in self.rules]}


@dataclass
class PeerPlan:
    recipe: PeerRecipe
    plan: dict[str, str]                                 # every group of the model -> format
    unmatched: list[str] = field(default_factory=list)   # rules that decided no group, and why


def _load_rule(raw, where: str) -> Rule:
    if not isinstance(raw, dict):
        raise OcriaError(f"{where}: a rule is a mapping with kinds, format and optionally layers; got {raw!r}")
    unknown = set(raw) - _RULE_KEYS
    if unknown:
        raise OcriaError(f"{where}: unknown rule keys {sorted(unknown)}; a rule has {sorted(_RULE_KEYS)}")
    kinds = raw.get("kinds")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not kinds or not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        raise OcriaError(f"{where}: `kinds` must name one or more group kinds")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise OcriaError(f"{where}: unknown layer group kind {', '.join(map(repr, bad))}; kinds are "
                         f"{', '.join(KINDS)}")
    fmt = raw.get("format")
    if fmt not in FORMATS:
        raise OcriaError(f"{where}: unknown format {fmt!r}; formats are {', '.join(FORMATS)}")
    layers = raw.get("layers")
    if layers is not None:
        try:
            parse_layers(layers, 64)
        except ValueError as e:
            raise OcriaError(f"{where}: {e}") from None
        layers = layers if isinstance(layers, str) else str(layers)
    rule = Rule(tuple(kinds), fmt, layers)
    # A block name (linear_attn) that covers gdn_ab is fine: gdn_ab stays BF16 as the design says.
    named = [k for k in kinds if k in ALWAYS_BF16_KINDS]
    if fmt != "bf16" and named:
        raise OcriaError(f"{where}: gives {', '.join(named)} {fmt}, but {', '.join(named)} groups always stay BF16 "
                         "in ocriaquant; this recipe cannot be exported as it stands")
    if fmt != "bf16" and "mtp" in kinds:
        raise OcriaError(f"{where}: gives mtp {fmt}, but ocriaquant carries mtp.* over untouched in BF16")
    return rule


def load_recipe(name_or_path: str | Path) -> PeerRecipe:
    """A peer recipe by name (ocriaquant/recipes/peers/NAME.yaml) or by path, validated."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = PEERS_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise OcriaError(f"no peer recipe {str(name_or_path)!r}; known: {', '.join(available()) or 'none'} "
                             f"(in {PEERS_DIR}), or pass a YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise OcriaError(f"{path}: cannot read peer recipe ({e})") from e
    if not isinstance(data, dict):
        raise OcriaError(f"{path}: a peer recipe is a mapping (name, source, default, rules)")
    unknown = set(data) - _RECIPE_KEYS
    if unknown:
        raise OcriaError(f"{path}: unknown keys {sorted(unknown)}; a peer recipe has {sorted(_RECIPE_KEYS)}")
    for key in ("name", "source"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise OcriaError(f"{path}: needs `{key}`")
    default = data.get("default", "bf16")
    if default not in FORMATS:
        raise OcriaError(f"{path}: unknown default format {default!r}; formats are {', '.join(FORMATS)}")
    rules = data.get("rules") or []
    if not isinstance(rules, list):
        raise OcriaError(f"{path}: `rules` is a list")
    parsed = tuple(_load_rule(r, f"{path}, rule {i + 1}") for i, r in enumerate(rules))
    return PeerRecipe(name=data["name"], title=str(data.get("title") or data["name"]), source=data["source"],
                      default=default, rules=parsed, note=str(data.get("note") or ""), path=path)


def available() -> list[str]:
    """Names of the bundled peer recipes."""
    return sorted(p.stem for p in PEERS_DIR.glob("*.yaml")) if PEERS_DIR.is_dir() else []


def select(spec: str | Sequence[str] | None) -> list[PeerRecipe]:
    """`none`, `all` or `NAME,NAME,...` (names or YAML paths) -> the recipes, loaded."""
    if spec is None:
        return []
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s and s.strip()]
    if not items or items == ["none"]:
        return []
    if items == ["all"]:
        items = available()
    if "all" in items or "none" in items:
        raise OcriaError("--peers takes none, all, or a comma-separated list of recipe names")
    recipes = [load_recipe(s) for s in items]
    names = [r.name for r in recipes]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise OcriaError(f"peer recipes named twice: {', '.join(dup)}")
    return recipes


# ---------------------------------------------------------------------------- plans for export

def recipe_plan(recipe: str | Path | PeerRecipe, model: str | Path | None = None, target: str = "h200"):
    """The plan a peer recipe gives `model` (default: the bundled model), for `ocriaquant export`.

    Only the model's config is read (groups on the meta device); the plan carries the model's
    fingerprint so export checks it, and the recipe and its unmatched rules as evidence."""
    from .artifacts import Plan, model_fingerprint
    from .model import discover_groups, load_config, meta_model
    from .model.load import resolve_model_dir
    from .quant.simulate import TARGETS

    if target not in TARGETS:
        raise OcriaError(f"unknown target {target!r}; targets are {', '.join(TARGETS)}")
    rec = recipe if isinstance(recipe, PeerRecipe) else load_recipe(recipe)
    model_dir = resolve_model_dir(model)
    mapped = rec.map(discover_groups(meta_model(load_config(model_dir))))
    if all(f == "bf16" for f in mapped.plan.values()):
        raise OcriaError(f"peer recipe {rec.name!r} leaves every layer group of {model_dir} in BF16: nothing to export")
    return Plan(groups=mapped.plan, target=target, model_dir=model_dir, model_fingerprint=model_fingerprint(model_dir),
                evidence={"recipe": rec.summary(), "unmatched_rules": mapped.unmatched})


def save_recipe_plan(recipe: str | Path | PeerRecipe, path: str | Path, model: str | Path | None = None,
                     target: str = "h200"):
    """`recipe_plan` written to `path` (plan.json, as search writes it); returns the Plan."""
    from .artifacts import save_plan

    plan = recipe_plan(recipe, model, target)
    save_plan(path, plan)
    return plan
