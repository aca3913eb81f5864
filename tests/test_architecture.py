"""The import direction of design.md section 3, checked two ways."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_api_loads_no_torch() -> None:
    code = (
        "import sys, app.main; app.main.create_app; "
        "heavy = sorted(m for m in ('torch', 'transformers', 'vllm', 'worker') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "", f"app.main imported: {out.stdout.strip()}"


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    out = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout
