"""The design's arrows, checked on the source: `cli -> pipeline -> verbs -> {artifacts, runtime,
model, quant, data, eval}`, `runtime -> kernels` and never back, `quant/` imports nothing of ours,
the runtime never imports llmcompressor. Every import counts, including those inside functions."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ocriaquant"
VERBS = ("calibrate", "search", "export", "quantize", "parse", "bench", "evaluate", "info")
ABOVE_VERBS = ("cli", "pipeline", "__main__")  # what may import verbs


def _module_name(path: Path, root: Path = PKG.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file of module `name`. `from X import a`
    yields X and X.a (a may be a submodule); relative imports resolve against the package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{a.name}") for a in node.names if a.name != "*"]
    return found


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _violations(modules, forbidden) -> list[str]:
    """`file:line imports X` for each import of a module in `modules` that `forbidden(importer, X)` refuses."""
    out = {}
    for name in modules:
        path = MODULES[name]
        for line, imported in _imports(path, name):
            where = f"{path.relative_to(PKG.parent)}:{line}"
            if forbidden(name, imported) and len(imported) < len(out.get(where, imported + ".")):
                out[where] = imported  # `from X import a` is reported once, as X
    return [f"{where} imports {imported}" for where, imported in sorted(out.items())]


def test_import_resolution_sees_relative_and_nested_imports(tmp_path):
    """The checker itself: relative imports of each level and imports inside functions are found."""
    pkg = tmp_path / "ocriaquant" / "runtime" / "kernels"
    pkg.mkdir(parents=True)
    (pkg / "k.py").write_text("from .splitk import x\ndef f():\n    from ...quant import nvfp4\n"
                              "    import ocriaquant.errors\nfrom .. import partials\n")
    name = _module_name(pkg / "k.py", tmp_path)
    assert name == "ocriaquant.runtime.kernels.k"
    got = {m for _, m in _imports(pkg / "k.py", name)}
    assert {"ocriaquant.runtime.kernels.splitk", "ocriaquant.quant", "ocriaquant.quant.nvfp4", "ocriaquant.errors",
            "ocriaquant.runtime", "ocriaquant.runtime.partials"} <= got


def test_kernels_import_nothing_of_ours_outside_kernels():
    kernels = [m for m in MODULES if _under(m, "ocriaquant.runtime.kernels")]
    assert kernels
    bad = _violations(kernels, lambda _, x: _under(x, "ocriaquant") and not _under(x, "ocriaquant.runtime.kernels"))
    assert not bad, "kernels/ are leaves:\n" + "\n".join(bad)


def test_quant_imports_nothing_of_ours_outside_quant():
    quant = [m for m in MODULES if _under(m, "ocriaquant.quant")]
    assert quant
    bad = _violations(quant, lambda _, x: _under(x, "ocriaquant") and not _under(x, "ocriaquant.quant"))
    assert not bad, "quant/ imports nothing of ours:\n" + "\n".join(bad)


def test_runtime_never_imports_llmcompressor():
    runtime = [m for m in MODULES if _under(m, "ocriaquant.runtime")]
    bad = _violations(runtime, lambda _, x: _under(x, "llmcompressor"))
    assert not bad, "the runtime never imports llmcompressor:\n" + "\n".join(bad)


def test_no_verb_imports_another_verb():
    verbs = {f"ocriaquant.{v}" for v in VERBS}
    present = [m for m in MODULES if m in verbs]
    assert len(present) >= 6
    bad = _violations(present, lambda me, x: any(_under(x, v) for v in verbs - {me}))
    assert not bad, "verbs share artifacts, never each other:\n" + "\n".join(bad)


def test_nothing_below_the_verbs_imports_them():
    """artifacts, runtime, model, quant, data, eval, files, errors: none imports a verb, the
    pipeline or the CLI (only the CLI and the pipeline reach verbs)."""
    tops = {f"ocriaquant.{m}" for m in VERBS + ABOVE_VERBS}
    below = [m for m in MODULES if m not in tops and m != "ocriaquant"]
    assert "ocriaquant.artifacts" in below
    bad = _violations(below, lambda _, x: any(_under(x, t) for t in tops))
    assert not bad, "arrows point down, never up to the verbs:\n" + "\n".join(bad)


def test_recipes_ship_inside_the_package():
    """The recipes are package data (pyproject's package-data), found through one constant: a
    non-editable install carries them, and nothing reads them from the source tree."""
    import ocriaquant
    from ocriaquant import peers, search
    from ocriaquant.recipes import RECIPES
    from ocriaquant.runtime import tiles

    pkg = Path(ocriaquant.__file__).resolve().parent
    assert RECIPES == pkg / "recipes" and RECIPES.is_dir()
    for name in ("default.yaml", "latency_h200.json", "tiles/h200.json"):
        assert (RECIPES / name).is_file(), name
    assert len(list((RECIPES / "peers").glob("*.yaml"))) >= 4
    assert search.DEFAULT_POLICY.parent == peers.PEERS_DIR.parent == tiles.DEFAULT_FILE.parent.parent == RECIPES
