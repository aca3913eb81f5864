"""The house's size and wording rules, checked on the source of the product and the benchmarks:
no module over 400 lines, no function over 80 (small modules with one job each, functions a
reader holds in mind), and no docstring or comment citing an issue number (a newcomer cannot
read the tracker: the text says the reason, or names the doc that explains it). Each check is
also run on a planted violation, so it can fail."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "worker", "trainer", "jobspec", "grading", "specbase", "inference", "grpo_cli")
CHECKED = (*PACKAGES, "bench")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
ISSUE_CITATION = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def sources() -> list[Path]:
    return sorted(p for name in CHECKED for p in (ROOT / name).rglob("*.py"))


def long_modules(paths: list[Path], root: Path = ROOT) -> list[str]:
    """Each module over MAX_MODULE_LINES, with its length (named relative to `root`)."""
    found = []
    for path in paths:
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{path.relative_to(root)}: {lines} lines")
    return found


def long_functions(source: str, where: str) -> list[str]:
    """Each function (or method) of `source` over MAX_FUNCTION_LINES, def to last line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{where}: {node.name} is {length} lines")
    return found


def citations(source: str, where: str) -> list[str]:
    """Each line of `source` that cites an issue number."""
    return [
        f"{where}:{number}: {line.strip()}"
        for number, line in enumerate(source.splitlines(), start=1)
        if ISSUE_CITATION.search(line)
    ]


def test_no_module_is_over_400_lines() -> None:
    assert long_modules(sources()) == []


def test_no_function_is_over_80_lines() -> None:
    found = []
    for path in sources():
        found += long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert found == []


def test_no_docstring_or_comment_cites_an_issue_number() -> None:
    found = []
    for path in sources():
        found += citations(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert found == []


def test_each_check_catches_its_violation(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n", "planted") == ["planted: f is 81 lines"]
    assert long_functions(f"def f():\n{body[: body.rindex(chr(10))]}\n", "planted") == []
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    planted = sorted(tmp_path.glob("*.py"))
    assert long_modules(planted, tmp_path) == ["long.py: 401 lines"]
    for cited in ("# see issue 36", '"""Fixed (Issue 4, item 2)."""', "# issues 12 and 13"):
        assert citations(cited, "planted") == [f"planted:1: {cited}"]
    assert citations("# the issue is the lock order; 36 rows", "planted") == []
