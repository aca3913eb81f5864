"""The SmolLM2-135M arithmetic recipe on CPU (about 30 minutes): held-out accuracy must rise.

Run with `make test-slow` (or `pytest -m slow tests/test_smollm2_run.py`). The figures of the
committed run are in BENCHMARKS.md and docs/smollm2-arithmetic.png.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_arithmetic_recipe_raises_held_out_accuracy(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "scripts/smollm2_run.py",
            "--out",
            str(tmp_path / "run"),
            "--plot",
            str(tmp_path / "plot.png"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3 * 3600,
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("summary: "))
    summary = json.loads(line.removeprefix("summary: "))
    assert summary["eval_accuracy_after"] > summary["eval_accuracy_before"], summary
    assert out.returncode == 0
    assert (tmp_path / "plot.png").is_file()
