"""The agent sections of the job spec: tools, environment, episode budgets."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from jobspec import JobSpec

MULTIPLY = "def multiply(a, b):\n    return a * b\n"
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
    "implementation": {"type": "python", "source": MULTIPLY},
}


def job(**fields: Any) -> dict[str, Any]:
    return {
        "model": "tiny-random-llama",
        "dataset": {"rows": [{"prompt": "2*3?", "answer": "6"}]},
        "graders": [{"type": "exact_match"}],
        **fields,
    }


def errors(spec: dict[str, Any]) -> list[tuple[tuple[Any, ...], str]]:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(spec)
    return [(tuple(e["loc"]), e["msg"]) for e in info.value.errors()]


def test_tools_environment_and_budgets_parse() -> None:
    http_tool = {
        "function": {"name": "search", "parameters": {"type": "object", "properties": {}}},
        "implementation": {"type": "http", "endpoint": "search-v1"},
    }
    spec = JobSpec.model_validate(
        job(
            tools=[TOOL, http_tool],
            environment={"type": "python", "source": "class Environment:\n    pass\n"},
            episode={"max_turns": 3, "max_tool_calls": 4, "tool_timeout_s": 2.5},
        )
    )
    assert [t.function.name for t in spec.tools] == ["multiply", "search"]
    assert spec.tools[1].type == "function"
    assert spec.episode.max_turns == 3 and spec.episode.max_episode_tokens == 4096
    assert spec.is_agentic
    assert not JobSpec.model_validate(job()).is_agentic
    assert "url" not in spec.model_dump()["tools"][0]["implementation"]


@pytest.mark.parametrize(
    ("where", "loc"),
    [
        (("implementation",), ("tools", 0, "implementation", "http", "url")),
        (("function",), ("tools", 0, "function", "url")),
        ((), ("tools", 0, "url")),
    ],
)
def test_a_url_in_a_tool_is_refused_naming_the_field(
    where: tuple[str, ...], loc: tuple[Any, ...]
) -> None:
    tool = copy.deepcopy(TOOL)
    tool["implementation"] = {"type": "http", "endpoint": "calc"}
    part = tool
    for key in where:
        part = part[key]
    part["url"] = "http://169.254.169.254/latest/meta-data"
    found = errors(job(tools=[tool]))
    assert len(found) == 1, found
    assert found[0][0] == loc
    assert "never carries a URL" in found[0][1]


def test_a_url_in_an_environment_is_refused_naming_the_field() -> None:
    found = errors(job(environment={"type": "http", "endpoint": "env", "url": "http://x"}))
    assert found[0][0] == ("environment", "http", "url")
    assert "never carries a URL" in found[0][1]


def test_a_remote_reference_in_the_parameters_is_refused() -> None:
    tool = copy.deepcopy(TOOL)
    tool["function"]["parameters"]["properties"]["a"] = {"$ref": "https://evil.example/s.json"}
    found = errors(job(tools=[tool]))
    assert found[0][0] == ("tools", 0, "function", "parameters")
    assert "parameters.properties.a.$ref" in found[0][1]
    # A local reference, and a parameter that happens to be called url, are fine.
    tool["function"]["parameters"]["properties"]["a"] = {"$ref": "#/$defs/n"}
    tool["function"]["parameters"]["properties"]["url"] = {"type": "string"}
    JobSpec.model_validate(job(tools=[tool]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"implementation": {"type": "python", "source": "def add(a, b): ..."}}, "multiply"),
        ({"implementation": {"type": "python", "source": "def multiply(:"}}, "compile"),
        ({"implementation": {"type": "http", "endpoint": "http://x/y"}}, "pattern"),
        ({"function": {"name": "bad name"}}, "pattern"),
        ({"function": {"name": "f", "parameters": {"type": "array"}}}, "object schema"),
        ({"function": {"name": "f", "parameters": {"d": "x" * 20_000}}}, "characters"),
    ],
)
def test_bad_tools_are_refused(change: dict[str, Any], message: str) -> None:
    tool = {**copy.deepcopy(TOOL), **change}
    assert any(message in msg for _, msg in errors(job(tools=[tool])))


def test_tool_names_are_unique_and_budgets_bounded() -> None:
    assert "unique" in errors(job(tools=[TOOL, TOOL]))[0][1]
    for budget in ({"max_turns": 0}, {"max_turns": 65}, {"tool_timeout_s": 0}):
        assert errors(job(episode=budget))[0][0][0] == "episode"
    source = "class Env:\n    pass\n"
    found = errors(job(environment={"type": "python", "source": source}))
    assert "class Environment" in found[0][1]
