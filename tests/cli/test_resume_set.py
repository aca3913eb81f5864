"""`grpo jobs resume JOB --set FIELD=NUMBER` (issue 45): what it sends to the API and how it
reports the answer, against a recording stand-in for the API (the API's side:
tests/app/jobs/test_resume_with_changes.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from grpo_cli.ci_args import Exit
from tests.cli.helpers import cli

JOB = "job_0123456789abcdef"
CONNECTION = ("--api-url", "http://api.test", "--api-key", "k")

Answer = Callable[[httpx.Request], httpx.Response]


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Callable[[Answer], list[httpx.Request]]:
    """Route the CLI's HTTP client to ``answer``; the requests it made."""

    def install(answer: Answer) -> list[httpx.Request]:
        seen: list[httpx.Request] = []
        real = httpx.Client

        def handler(request: httpx.Request) -> httpx.Response:
            seen.append(request)
            return answer(request)

        def client(*args: Any, **kw: Any) -> httpx.Client:
            return real(*args, transport=httpx.MockTransport(handler), **kw)

        monkeypatch.setattr(httpx, "Client", client)
        return seen

    return install


def queued(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"id": JOB, "status": "queued"})


def test_set_sends_the_changes_with_their_numbers(api: Callable[[Answer], Any]) -> None:
    seen = api(queued)
    result = cli(
        "jobs",
        "resume",
        JOB,
        "--set",
        "grpo.learning_rate=1e-5",
        "--set",
        "grpo.async.max_staleness=1",
        *CONNECTION,
    )
    assert result.code == Exit.OK, result.err
    assert result.out.strip() == f"job {JOB}: queued"
    [request] = seen
    assert (request.method, request.url.path) == ("POST", f"/v1/jobs/{JOB}/resume")
    body = json.loads(request.content)
    assert body == {"set": {"grpo.learning_rate": 1e-5, "grpo.async.max_staleness": 1}}
    assert isinstance(body["set"]["grpo.async.max_staleness"], int)  # an int stays one
    assert cli("jobs", "resume", JOB, *CONNECTION).code == Exit.OK
    assert seen[1].content == b""  # without --set, the resume is as before: no body


def test_a_refused_field_exits_2_naming_it(api: Callable[[Answer], Any]) -> None:
    def refused(request: httpx.Request) -> httpx.Response:
        error = {
            "type": "invalid_request_error",
            "message": "grpo.temperature: cannot be changed on resume",
            "param": "grpo.temperature",
        }
        return httpx.Response(422, json={"error": error})

    seen = api(refused)
    result = cli("jobs", "resume", JOB, "--set", "grpo.temperature=0.5", *CONNECTION)
    assert result.code == Exit.USAGE
    assert "grpo.temperature: cannot be changed on resume" in result.err
    assert "(param grpo.temperature)" in result.err
    assert len(seen) == 1  # a refusal is not retried


@pytest.mark.parametrize("setting", ["grpo.learning_rate", "=1", "grpo.steps=ten", "x=true"])
def test_a_setting_that_is_not_field_equals_number_is_a_usage_error(setting: str) -> None:
    result = cli("jobs", "resume", JOB, "--set", setting, *CONNECTION)
    assert result.code == Exit.USAGE == 2
    assert "usage: grpo" in result.err and "--set" in result.err
