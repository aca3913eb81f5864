"""The import contracts (pyproject.toml, checked by `make lint` and tests/test_architecture.py)
say what the design says, and cannot pass by accident:

- a forbidden import planted in a copy of the tree breaks the contract that names it: an
  `app -> trainer` import, a `grading -> jobspec` import (the floors of the torch-free ground),
  a `jobspec -> torch` import;
- every module of an app domain has its place in the per-domain layers, so a new module cannot
  slip past them unconstrained;
- the modules that must know nothing of HTTP are exactly the layers below `deps`, so the two
  contracts cannot drift apart.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
DOMAIN_LAYERS = "inside every domain, layers import downwards only"
HTTP_FREE = "services, the state machine and repositories know nothing of HTTP"
# The app's modules outside any domain that are HTTP-free too (the core's repositories).
CORE_REPOSITORIES = ["app.core.new_rows_repository", "app.core.projects_repository"]

# (file planted in the copy, its import, the start of the name of the contract it must break)
PLANTED = [
    (
        "app/core/planted_probe.py",
        "import trainer.run.loop",
        "app and inference import nothing of trainer",
    ),
    (
        "grading/planted_probe.py",
        "import jobspec.job",
        "the torch-free ground in floors: jobspec above grading, both above specbase",
    ),
    (
        "jobspec/planted_probe.py",
        "import torch",
        "jobspec, grading and specbase import no torch and no trainer",
    ),
]


def _contract(name_start: str) -> dict[str, Any]:
    (found,) = [c for c in CONFIG["contracts"] if c["name"].startswith(name_start)]
    return found


def _layer_names(contract: dict[str, Any]) -> list[list[str]]:
    """Each layer's module names, top first (optional layers written `(name)`)."""
    return [[part.strip().strip("()") for part in layer.split(":")] for layer in contract["layers"]]


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    lint = Path(sys.executable).parent / "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(lint)], cwd=tree, capture_output=True, text=True, env=env)


def test_every_module_of_an_app_domain_has_a_layer() -> None:
    contract = _contract(DOMAIN_LAYERS)
    placed = {name for layer in _layer_names(contract) for name in layer}
    left_out = [
        f"{container}.{module.stem}"
        for container in contract["containers"]
        for module in sorted((ROOT / container.replace(".", "/")).glob("*.py"))
        if module.stem != "__init__" and module.stem not in placed
    ]
    assert left_out == [], f"give these modules a layer in pyproject.toml: {left_out}"


def test_the_http_free_modules_are_the_layers_below_deps() -> None:
    layers = _layer_names(_contract(DOMAIN_LAYERS))
    below_deps = layers[[names[0] for names in layers].index("deps") + 1 :]
    expected = [f"app.*.{name}" for names in below_deps for name in names] + CORE_REPOSITORIES
    assert _contract(HTTP_FREE)["source_modules"] == expected


def test_a_planted_forbidden_import_breaks_its_contract(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(ROOT / "pyproject.toml", tree)
    for package in CONFIG["root_packages"]:
        shutil.copytree(
            ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    clean = _lint(tree)
    assert clean.returncode == 0, clean.stdout[-2000:]  # the copy itself is sound
    for path, statement, _ in PLANTED:
        (tree / path).write_text(f'"""A probe of tests/test_contracts.py."""\n\n{statement}\n')
    planted = _lint(tree)
    assert planted.returncode != 0
    report = " ".join(planted.stdout.split())  # lint-imports wraps long contract names
    for _, _, name_start in PLANTED:
        name = " ".join(_contract(name_start)["name"].split())
        assert f"{name} BROKEN" in report, (name, report[-3000:])
