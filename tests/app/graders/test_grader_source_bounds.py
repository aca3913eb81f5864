"""Python grader sources built to crash the parser (issue 32, hostile tenant): 30-60 KB of
one long expression, within the field's 64,000 characters, made CPython's parser raise
RecursionError or MemoryError, and every route that validates a grader answered 500. Each is
now a 4xx naming the field, on every route, and a deep source within the bound still loads."""

from __future__ import annotations

from typing import Any

import pytest

from grading.python_source import MAX_SOURCE_NESTING
from tests.conftest import Api, tiny_spec

GRADE = "def grade(sample, item):\n    return 1.0\n"
CRASHERS = {
    # 14,000 additions: RecursionError while the tree is built (~56 KB).
    "a long sum": GRADE + "x = 1" + " + 1" * 14_000 + "\n",
    # 30,000 unary minuses: MemoryError, the parser's stack overflowing (~30 KB).
    "a long unary chain": GRADE + "x = " + "-" * 30_000 + "1\n",
    # Parses, but deeper than the sandbox's compiler is sure to take.
    "just past the bound": GRADE + "x = 1" + " + 1" * MAX_SOURCE_NESTING + "\n",
}


def _routes(grader: dict[str, Any]) -> list[tuple[str, dict[str, Any], int, str]]:
    """(path, body, status, param) of every route that validates a grader."""
    job = tiny_spec() | {"graders": [grader]}
    one = {"grader": grader, "model_sample": "1", "item": {}}
    return [
        ("/v1/jobs", job, 422, "graders[0].source"),
        ("/v1/jobs/validate", job, 422, "graders[0].source"),
        ("/v1/graders/validate", {"grader": grader}, 422, "grader.source"),
        ("/v1/graders/run", one, 422, "grader.source"),
        # OpenAI's face answers its SDK's 400 for the same refusal.
        ("/v1/fine_tuning/alpha/graders/validate", {"grader": grader}, 400, "grader.source"),
    ]


@pytest.mark.parametrize("case", sorted(CRASHERS))
def test_a_source_that_nests_too_deeply_is_refused_naming_the_field(api: Api, case: str) -> None:
    grader = {"type": "python", "source": CRASHERS[case]}
    assert len(grader["source"]) <= 64_000  # within the field's size bound
    for path, body, status, param in _routes(grader):
        response = api.client.post(path, json=body, headers=api.headers)
        assert response.status_code == status, (case, path, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (case, path, error)
        assert f"at most {MAX_SOURCE_NESTING} levels" in error["message"], (case, path, error)


def test_a_deep_source_within_the_bound_is_accepted(api: Api) -> None:
    # The tree of `x = 1 + 1 + ...` is one level per addition, under a few of the module's.
    grader = {"type": "python", "source": GRADE + "x = 1" + " + 1" * (MAX_SOURCE_NESTING - 10)}
    for path, body, _, _ in _routes(grader)[1:3]:  # the dry runs: nothing created
        response = api.client.post(path, json=body, headers=api.headers)
        assert response.status_code == 200, (path, response.text)


# The same parser runs on a python tool's and a python environment's source
# (jobspec/agents.py).
def test_a_tool_or_environment_source_that_nests_too_deeply_is_refused(api: Api) -> None:
    crasher = CRASHERS["a long unary chain"]
    tool = {
        "type": "function",
        "function": {"name": "one", "parameters": {"type": "object", "properties": {}}},
        "implementation": {"type": "python", "source": "def one():\n    return 1\n" + crasher},
    }
    environment = {"type": "python", "source": "class Environment:\n    pass\n" + crasher}
    # Named as agents.py names a source that defines no such function: the tool, the environment.
    for changes, param in (({"tools": [tool]}, "tools[0]"), ({"environment": environment}, "env")):
        spec = tiny_spec() | {"dataset": {"rows": [{"prompt": "q"}] * 8}} | changes
        response = api.client.post("/v1/jobs/validate", json=spec, headers=api.headers)
        assert response.status_code == 422, (param, response.text)
        error = response.json()["error"]
        assert error["param"].startswith(param), error
        assert f"at most {MAX_SOURCE_NESTING} levels" in error["message"], error
