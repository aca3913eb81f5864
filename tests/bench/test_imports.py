"""Every benchmark module imports: a benchmark is run by hand, rarely, so a rename elsewhere
(a module moved, a constant renamed) would otherwise surface only on the day someone reruns it.

A client that drives the service through the official `tinker` SDK runs in the SDK's own
environment (`.venv-tinker`, without torch or the project): it imports there, and imports
nothing of the project."""

from __future__ import annotations

import ast
import importlib
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SDK_PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
PROJECT_PACKAGES = {"app", "worker", "trainer", "jobspec", "grading", "specbase", "grpo_cli",
                    "inference", "bench", "tests"}  # fmt: skip


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return {name.split(".")[0] for name in names}


FILES = sorted(p for p in BENCH.glob("*.py") if p.stem != "__init__")
SDK_CLIENTS = sorted(p.stem for p in FILES if "tinker" in _imports(p))
MODULES = sorted(p.stem for p in FILES if p.stem not in SDK_CLIENTS)


def test_the_benchmarks_are_found() -> None:
    assert {"chaos", "chaos_cluster", "kl_study", "gpu_update"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_module_imports(name: str) -> None:
    importlib.import_module(f"bench.{name}")


@pytest.mark.parametrize("name", SDK_CLIENTS)
def test_every_tinker_sdk_client_imports_in_the_sdks_environment(name: str) -> None:
    path = BENCH / f"{name}.py"
    assert not _imports(path) & PROJECT_PACKAGES, "an SDK client runs without the project"
    if not SDK_PYTHON.exists():  # made by `make setup` (scripts/setup.sh)
        pytest.skip(".venv-tinker is missing: run make setup")
    code = f"import runpy; runpy.run_path({str(path)!r}, run_name='not_main')"
    done = subprocess.run(
        [str(SDK_PYTHON), "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
