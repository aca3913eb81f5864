"""Agent jobs at the API (issue 27): an http tool or http environment names one of the
operator's tool endpoints (GRPO_TOOL_ENDPOINTS) or the job is a 422 naming the field at
submission; OpenAI's agent RFT tools (method.reinforcement.tools) map to the native tools, with
their implementation from grpo_service.tool_implementations, and a tool's URL is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import BadRequestError, OpenAI

from tests.app.fine_tuning.test_fine_tuning_api import ROWS, create, error, request, upload
from tests.conftest import Api, tiny_spec

CALC = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}
SOURCE = "def multiply(a, b=1):\n    return a * b\n"


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    endpoints = {"calc": {"url": "http://127.0.0.1:9/calc"}, "maze": {"url": "http://127.0.0.1:9"}}
    monkeypatch.setenv("GRPO_TOOL_ENDPOINTS", json.dumps(endpoints))


def agent_spec(endpoint: str = "calc", env_endpoint: str | None = None) -> dict[str, Any]:
    spec = tiny_spec() | {
        "dataset": {"generator": {"type": "arithmetic", "count": 16}, "use_chat_template": True},
        "tools": [
            {**CALC, "implementation": {"type": "python", "source": SOURCE}},
            {
                **CALC,
                "function": {**CALC["function"], "name": "lookup"},
                "implementation": {"type": "http", "endpoint": endpoint},
            },
        ],
    }
    if env_endpoint is not None:
        spec["environment"] = {"type": "http", "endpoint": env_endpoint}
    return spec


def test_http_tools_and_environments_must_name_a_registered_endpoint(api: Api) -> None:
    def submit(path: str, spec: dict[str, Any]) -> Any:
        return api.client.post(path, json=spec, headers=api.headers)

    for path in ("/v1/jobs/validate", "/v1/jobs"):
        ok = submit(path, agent_spec("calc", env_endpoint="maze"))
        assert ok.status_code in (200, 201), ok.text
        tool = submit(path, agent_spec("elsewhere"))
        assert tool.status_code == 422, tool.text
        got = tool.json()["error"]
        assert got["param"] == "tools[1].implementation.endpoint"
        assert "'elsewhere'" in got["message"] and "calc, maze" in got["message"]
        env = submit(path, agent_spec("calc", env_endpoint="nowhere"))
        assert env.status_code == 422, env.text
        assert env.json()["error"]["param"] == "environment.endpoint"


def test_no_registry_refuses_every_http_tool(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPO_TOOL_ENDPOINTS")
    response = api.client.post("/v1/jobs/validate", json=agent_spec(), headers=api.headers)
    assert response.status_code == 422
    assert "none are configured" in response.json()["error"]["message"]
    python_only = agent_spec()
    python_only["tools"] = python_only["tools"][:1]
    response = api.client.post("/v1/jobs/validate", json=python_only, headers=api.headers)
    assert response.status_code == 200, response.text


# ---- OpenAI's agent RFT ----------------------------------------------------------------------


def agent_request(file_id: str, tools: list[dict[str, Any]], **impls: Any) -> dict[str, Any]:
    body = request(file_id)
    body["method"]["reinforcement"]["tools"] = tools
    body["grpo_service"] |= {"use_chat_template": True, "tool_implementations": impls}
    return body


def test_agent_rft_tools_map_to_native_tools(api: Api) -> None:
    file = upload(api, ROWS)
    flat = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    body = agent_request(
        file["id"],
        [CALC, flat],
        multiply={"type": "python", "source": SOURCE},
        lookup={"type": "http", "endpoint": "calc"},
    )
    body["method"]["reinforcement"]["max_episode_steps"] = 3
    body["grpo_service"]["environment"] = {"type": "http", "endpoint": "maze", "weight": 0.5}
    response = create(api, body)
    assert response.status_code == 200, response.text
    job = response.json()
    shown = job["method"]["reinforcement"]["tools"]
    assert [t["function"]["name"] for t in shown] == ["multiply", "lookup"]
    native = api.client.get(f"/v1/jobs/{job['id']}", headers=api.headers).json()["spec"]
    assert native["tools"][0]["function"] == {**CALC["function"], "strict": None}
    assert native["tools"][0]["implementation"] == {"type": "python", "source": SOURCE}
    assert native["tools"][1]["function"]["name"] == "lookup"
    assert native["tools"][1]["implementation"] == {"type": "http", "endpoint": "calc"}
    assert native["episode"]["max_turns"] == 3
    assert native["environment"]["endpoint"] == "maze"


def test_agent_rft_refusals_name_the_request_field(api: Api) -> None:
    file = upload(api, ROWS)
    python = {"type": "python", "source": SOURCE}
    cases: list[tuple[dict[str, Any], str, str]] = [
        # OpenAI's hosted tools call the caller's URL: refused, saying what to give instead.
        (agent_request(file["id"], [{**CALC, "url": "https://x.test/t"}], multiply=python),
         "method.reinforcement.tools[0].url", "tool_implementations"),
        (agent_request(file["id"], [{"name": "multiply", "server_url": "https://x.test"}],
                       multiply=python),
         "method.reinforcement.tools[0].server_url", "endpoint"),
        (agent_request(file["id"], [CALC]), "method.reinforcement.tools[0]",
         "grpo_service.tool_implementations.multiply"),
        (agent_request(file["id"], [CALC], multiply=python, other=python),
         "grpo_service.tool_implementations.other", "no tool"),
        (agent_request(file["id"], [CALC], multiply={"type": "http", "url": "https://x.test"}),
         "grpo_service.tool_implementations.multiply", ""),
        (agent_request(file["id"], [CALC], multiply={"type": "http", "endpoint": "elsewhere"}),
         "grpo_service.tool_implementations.multiply.endpoint", "GRPO_TOOL_ENDPOINTS"),
        (agent_request(file["id"], [{**CALC, "function": {**CALC["function"], "name": "a b"}}],
                       **{"a b": python}),
         "method.reinforcement.tools[0].function.name", ""),
        (agent_request(file["id"], [{"type": "function", "name": "a b"}], **{"a b": python}),
         "method.reinforcement.tools[0].name", ""),
    ]  # fmt: skip
    for body, param, words in cases:
        response = create(api, body)
        got = error(response, response.status_code)
        assert response.status_code in (400, 422), (param, response.text)
        assert got["param"].startswith(param), (param, got)
        assert words in got["message"], (param, got)


def test_the_openai_sdk_sends_agent_tools_through_extra_body(api: Api) -> None:
    client = OpenAI(
        base_url="http://testserver/v1", api_key=api.key, http_client=api.client, max_retries=0
    )
    file = upload(api, ROWS)
    method: Any = {
        "type": "reinforcement",
        "reinforcement": {"grader": request(file["id"])["method"]["reinforcement"]["grader"]},
    }
    method["reinforcement"]["tools"] = [CALC]
    extra = {
        "rollout": {"engine": "transformers"},
        "use_chat_template": True,
        "tool_implementations": {"multiply": {"type": "http", "endpoint": "calc"}},
    }
    job = client.fine_tuning.jobs.create(
        model="tiny-random-llama",
        training_file=file["id"],
        method=method,
        extra_body={"grpo_service": extra},
    )
    assert job.status == "queued"
    native = api.client.get(f"/v1/jobs/{job.id}", headers=api.headers).json()["spec"]
    assert native["tools"][0]["implementation"] == {"type": "http", "endpoint": "calc"}
    method["reinforcement"]["tools"] = [{**CALC, "url": "https://x.test/tool"}]
    with pytest.raises(BadRequestError) as refused:
        client.fine_tuning.jobs.create(
            model="tiny-random-llama",
            training_file=file["id"],
            method=method,
            extra_body={"grpo_service": extra},
        )
    assert refused.value.param == "method.reinforcement.tools[0].url"  # type: ignore[attr-defined]
