"""A chat with tools, the rules that need no engine (issue 32 item 2: an agent trained here is
called as an agent): what of OpenAI's tool calling is not served is a 400 naming the field,
before anything is routed; a tool is validated as a job's tool is; and tools, or a
conversation holding tool calls, are refused rather than guessed at when the inference process
does not say how its engine's chat template takes them. The inference process is ControlDouble
(tests/app/gateway_doubles.py); the real engine's test is
tests/inference/test_served_as_trained.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.app.gateway_doubles import ControlDouble, Registry, serve_control
from tests.conftest import Api

CHAT = "/v1/chat/completions"
TINY = "tiny-random-llama"
TOOL = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "multiply", "arguments": json.dumps({"a": 6})},
}
TOOL_TURNS = [
    {"role": "user", "content": "what is 6*7?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "42"},
]


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": TINY, "messages": [{"role": "user", "content": "hi"}], **extra}


def _error(response: Any, param: str, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.fixture
def forwarded(api: Api) -> Iterator[ControlDouble]:
    """An inference process serving the tiny base that says nothing of its chat template (an
    older process): a request past the gateway's checks reaches its ensure."""
    with serve_control(ControlDouble(base_url="http://127.0.0.1:1", served_model="x")) as double:
        registry = Registry(api.settings)
        registry.register("tools", double.url, [TINY])
        try:
            yield double
        finally:
            registry.close()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_chat(tools=[TOOL], tool_choice="required"), "tool_choice"),
        (
            _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "m"}}),
            "tool_choice",
        ),
        (_chat(tools=[TOOL], stream=True), "stream"),
        (_chat(tools=[TOOL], tool_choice="auto", stream=True), "stream"),
    ],
)
def test_what_of_tool_calling_is_not_served_is_refused_naming_it(
    api: Api, forwarded: ControlDouble, body: dict[str, Any], param: str
) -> None:
    error = _error(api.client.post(CHAT, json=body, headers=api.headers), param)
    assert error["code"] == "unsupported_parameter", error
    assert forwarded.received == []  # refused before any inference process was asked


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({**TOOL, "function": {**TOOL["function"], "name": "two words"}}, "tools[0].function.name"),
        (
            {**TOOL, "function": {**TOOL["function"], "parameters": {"type": "string"}}},
            "tools[0].function.parameters",
        ),
        ({**TOOL, "function": {**TOOL["function"], "url": "http://x"}}, "tools[0].function.url"),
        ({**TOOL, "type": "code_interpreter"}, "tools[0].type"),
        (
            {**TOOL, "function": {**TOOL["function"], "description": "a\x00b"}},
            "tools[0].function.description",
        ),
    ],
)
def test_a_tool_is_validated_as_a_jobs_tool_is(
    api: Api, forwarded: ControlDouble, tool: dict[str, Any], param: str
) -> None:
    response = api.client.post(CHAT, json=_chat(tools=[tool]), headers=api.headers)
    _error(response, param)
    assert forwarded.received == []


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "user", "content": "hi", "tool_calls": [CALL]}], "messages[0].tool_calls"),
        ([{"role": "assistant", "content": None}], "messages[0].content"),
        ([{"role": "assistant", "tool_calls": [{**CALL, "id": None}]}], "messages[0].tool_calls"),
        ([{"role": "assistant", "content": "x", "refusal": "no"}], "messages[0].refusal"),
    ],
)
def test_tool_turns_are_checked(
    api: Api, forwarded: ControlDouble, messages: list[dict[str, Any]], param: str
) -> None:
    response = api.client.post(CHAT, json=_chat(messages=messages), headers=api.headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param), response.text  # or a part of it
    assert forwarded.received == []


def test_the_tools_limit_is_the_services(api: Api, forwarded: ControlDouble) -> None:
    response = api.client.post(CHAT, json=_chat(tools=[TOOL] * 129), headers=api.headers)
    _error(response, "tools")


@pytest.mark.parametrize(
    "body",
    [_chat(tools=[TOOL]), _chat(messages=TOOL_TURNS)],
    ids=["tools", "tool-turns"],
)
def test_tools_are_refused_when_the_engines_template_is_not_known(
    api: Api, forwarded: ControlDouble, body: dict[str, Any]
) -> None:
    """Written wrong, an agent's prompt silently differs from its training: the gateway says
    so instead (an inference process older than the traits in its ensure answer)."""
    response = api.client.post(CHAT, json=body, headers=api.headers)
    error = _error(response, "tools" if "tools" in body else "messages", "unsupported_parameter")
    assert "chat template" in error["message"], error
    assert len(forwarded.received) == 1  # the process was asked; no engine was called
