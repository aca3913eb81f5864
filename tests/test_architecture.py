"""The import direction of design.md section 3, checked two ways, and the layer rules of the
service (queries in repositories, commits at the boundary) checked on the source."""

from __future__ import annotations

import ast
import importlib.util
import re
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


def import_cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among `imports` (module -> the modules it imports), each a sorted list
    of its modules (Tarjan's strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in imports.get(module, ()):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = [stack.pop()]
            while component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(imports):
        if module not in index:
            visit(module)
    return cycles


def project_imports() -> dict[str, set[str]]:
    """Every import between the project's modules, at any level (in functions, under
    TYPE_CHECKING), as Python runs it: importing `a.b.c` runs `a` and `a.b` first, so each
    import also reaches the packages above its target, except the importer's own packages
    (they are already running when it loads)."""
    import grimp

    for package in PACKAGES:  # the graph must be this tree's, not an installed copy's
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.origin == str(ROOT / package / "__init__.py")
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    imports: dict[str, set[str]] = {}
    for module in graph.modules:
        if module.split(".")[0] not in PACKAGES:
            continue
        reached = imports.setdefault(module, set())
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.split(".")[0] not in PACKAGES or imported == module:
                continue
            reached.add(imported)
            parts = imported.split(".")
            for depth in range(1, len(parts)):
                package = ".".join(parts[:depth])
                if not module.startswith(package + "."):  # its own packages ran already
                    reached.add(package)
    return imports


def test_no_import_cycles() -> None:
    """No module imports itself back through others, function-level imports included. The
    acyclic_siblings contract checks the same between the children of each package; this also
    covers a package's __init__ with its own modules, and the four top-level packages."""
    cycles = import_cycles(project_imports())
    assert cycles == [], "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_catches_a_circle() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


# -- queries live in repositories; transactions end at a boundary ---------------------------

PACKAGES = ("app", "worker", "grpo_cli", "trainer", "jobspec", "grading", "specbase", "inference")
# The only place a statement is built or run: a repository module of a domain (or of the core),
# app/<domain>/repository.py or app/<domain>/<what>_repository.py.
QUERY_HOME = re.compile(r"^app/\w+/(\w+_)?repository\.py$")
BOUNDARY = "app/core/db.py"  # the only place a transaction ends (request, task and CLI boundaries)
# Session methods that read or write rows. (flush is allowed anywhere: it ends nothing.)
QUERY_METHODS = {
    "get",
    "execute",
    "scalar",
    "scalars",
    "query",
    "add",
    "add_all",
    "delete",
    "merge",
    "refresh",
}
TRANSACTION_METHODS = {"commit", "rollback"}
STATEMENT_BUILDERS = {"select", "insert", "update", "delete", "text"}
# The one writer of the Tinker API's status columns (app.tinker.states' moves).
TINKER_STATUS_WRITER = "app/tinker/status_repository.py"
# What a database session or connection is called in this code base.
SESSION_NAME = re.compile(r"(^|_)(session|sess|conn|connection)$")


def _receiver_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def layer_violations(relative: str, source: str) -> list[str]:
    """Why the module at `relative` (a path like "app/jobs/service.py") breaks the rules:
    queries only in repository modules, commit/rollback only at the boundary, job status
    compare-and-set only from app/jobs/transitions.py, a Tinker model's or call's status
    written only by app/tinker/status_repository.py."""
    found: list[str] = []
    tinker = relative.startswith("app/tinker/") or (
        relative.startswith("worker/") and "tinker" in relative
    )
    writes_tinker_status = tinker and relative != TINKER_STATUS_WRITER
    in_repositories = QUERY_HOME.match(relative) is not None
    sqlalchemy_aliases: set[str] = set()
    for node in ast.walk(ast.parse(source, filename=relative)):
        where = f"{relative}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
            module = node.module or ""
            names = {alias.name for alias in node.names}
            if not in_repositories and (
                module.startswith("sqlalchemy.dialects") or names & STATEMENT_BUILDERS
            ):
                found.append(f"{where}: imports {sorted(names)} from {module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("sqlalchemy.dialects") and not in_repositories:
                    found.append(f"{where}: imports {alias.name}")
                if alias.name == "sqlalchemy":
                    sqlalchemy_aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Attribute):
            receiver = _receiver_name(node.value)
            if (
                not in_repositories
                and isinstance(node.value, ast.Name)
                and receiver in sqlalchemy_aliases
                and node.attr in STATEMENT_BUILDERS
            ):
                found.append(f"{where}: builds a statement with {receiver}.{node.attr}")
            if node.attr == "compare_and_set" and relative != "app/jobs/transitions.py":
                found.append(f"{where}: only app/jobs/transitions.py changes a job's status")
        if writes_tinker_status:
            found += _tinker_status_writes(node, where)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = _receiver_name(node.func.value)
            method = node.func.attr
            if receiver is None or not SESSION_NAME.search(receiver):
                continue
            if method in QUERY_METHODS and not in_repositories:
                found.append(f"{where}: {receiver}.{method}() outside a repository module")
            if method in TRANSACTION_METHODS and relative != BOUNDARY:
                found.append(f"{where}: {receiver}.{method}() outside the boundary ({BOUNDARY})")
    return found


def _tinker_status_writes(node: ast.AST, where: str) -> list[str]:
    """A status written outside the Tinker status writer: an UPDATE's ``.values(status=...)``
    or an assignment to a row's ``.status``."""
    why = f"{where}: only {TINKER_STATUS_WRITER} changes a Tinker status"
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "values"
        and any(k.arg == "status" for k in node.keywords)
    ):
        return [why]
    if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if any(isinstance(t, ast.Attribute) and t.attr == "status" for t in targets):
            return [why]
    return []


def source_modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_queries_live_in_repositories_and_only_the_boundary_commits() -> None:
    problems = [
        problem
        for path in source_modules()
        for problem in layer_violations(path.relative_to(ROOT).as_posix(), path.read_text())
    ]
    assert problems == [], "\n".join(problems)


def test_the_layer_check_catches_each_kind_of_violation() -> None:
    service = "app/jobs/example.py"
    assert layer_violations(service, "def f(session):\n    return session.get(Job, 1)\n")
    assert layer_violations(service, "def f(self):\n    self._session.add(row)\n")
    assert layer_violations(service, "from sqlalchemy import select\n")
    assert layer_violations(service, "from sqlalchemy.dialects import postgresql\n")
    assert layer_violations(service, "import sqlalchemy as sa\nq = sa.update(Job)\n")
    assert layer_violations(service, "def f(session):\n    session.commit()\n")
    assert layer_violations(service, "jobs_repo.compare_and_set(session, job_id='j')\n")
    tinker_repository = "app/tinker/upkeep_repository.py"
    assert layer_violations(tinker_repository, "q = update(M).values(status='closed')\n")
    assert layer_violations("worker/tinker_model.py", "def f(model):\n    model.status = 'x'\n")
    assert not layer_violations(TINKER_STATUS_WRITER, "q = update(M).values(status='closed')\n")
    assert not layer_violations(tinker_repository, "q = update(M).values(idle_state=None)\n")
    # ...and leaves alone what is allowed.
    assert not layer_violations(service, "def f(session):\n    session.flush()\n")
    assert not layer_violations(service, "def f(d):\n    return d.get('key')\n")
    assert not layer_violations(service, "from sqlalchemy.orm import Session\n")
    assert not layer_violations("app/jobs/repository.py", "from sqlalchemy import select\n")
    assert not layer_violations(BOUNDARY, "def f(session):\n    session.commit()\n")
