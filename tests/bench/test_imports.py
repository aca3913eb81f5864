"""Every benchmark module imports: a benchmark is run by hand, rarely, so a rename elsewhere
(a module moved, a constant renamed) would otherwise surface only on the day someone reruns it."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
MODULES = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")


def test_the_benchmarks_are_found() -> None:
    assert {"chaos", "chaos_cluster", "kl_study", "gpu_update"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_module_imports(name: str) -> None:
    importlib.import_module(f"bench.{name}")
