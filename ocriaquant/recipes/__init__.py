"""The bundled recipes, as data shipped inside the package (pyproject's package-data): the search
policy (default.yaml), the latency table (latency_h200.json), GEMV tiles per GPU (tiles/*.json) and
the published recipes (peers/*.yaml). RECIPES is the one place their folder is named; every reader
imports it from here. Imports nothing of ours."""

from pathlib import Path

RECIPES = Path(__file__).resolve().parent
