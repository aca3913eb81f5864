"""POST /v1/graders/run and /validate: the same graders as a job, on one sample."""

from __future__ import annotations

import json
import shutil
import time
from typing import Any

import pytest

from tests.conftest import Api, tiny_spec
from tests.grading.test_graders_openai import MULTI


def run(api: Api, grader: dict[str, Any], sample: str, item: dict[str, Any]) -> Any:
    body = {"grader": grader, "model_sample": sample, "item": item}
    return api.client.post("/v1/graders/run", json=body, headers=api.headers)


def test_a_multi_grader_reports_its_reward_and_sub_rewards(api: Api) -> None:
    response = run(api, MULTI, "it is 7", {"answer": "7"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["reward"] == pytest.approx(0.7)
    assert body["sub_rewards"] == {"correct": 1.0, "format": 0.0}
    meta = body["metadata"]
    assert (meta["name"], meta["type"]) == ("Arithmetic", "multi")
    assert meta["errors"] == {"failure": None, "message": None}
    assert meta["scores"]["Arithmetic"] == pytest.approx(0.7) and meta["execution_time"] >= 0


def test_a_failing_grade_is_a_200_with_the_reason_not_an_error(api: Api) -> None:
    grader = {"type": "string_check", "reference": "{{ item.label }}", "operation": "eq"}
    body = run(api, grader, "x", {"answer": "7"}).json()
    assert body["reward"] == 0.0
    assert body["metadata"]["errors"]["failure"] == "error"
    assert "item.label is not in the item" in body["metadata"]["errors"]["message"]


def test_bad_graders_and_items_are_422_naming_the_field(api: Api) -> None:
    bad_formula = {**MULTI, "calculate_output": "correct + __import__('os')"}
    refused = api.client.post(
        "/v1/graders/validate", json={"grader": bad_formula}, headers=api.headers
    )
    assert refused.status_code == 422
    assert refused.json()["error"]["param"].startswith("grader")
    ok = api.client.post("/v1/graders/validate", json={"grader": MULTI}, headers=api.headers)
    assert ok.status_code == 200
    assert ok.json()["grader"]["graders"]["format"]["full_match"] is False  # defaults filled
    big = run(api, MULTI, "7", {f"f{i}": i for i in range(65)})
    assert big.status_code == 422 and big.json()["error"]["param"] == "item"
    assert api.client.post("/v1/graders/run", json={"grader": MULTI}).status_code == 401


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_a_python_grader_runs_in_the_sandbox_here_too(api: Api) -> None:
    source = "import os\n\ndef grade(sample, item):\n    return float(len(os.environ) < 5)"
    body = run(api, {"type": "python", "source": source}, "x", {}).json()
    assert body["reward"] == 1.0  # an empty environment: no database URL, no keys
    hostile = "def grade(sample, item):\n    return 1.0 if open('/etc/passwd').read() else 0"
    body = run(api, {"type": "python", "source": hostile}, "x", {}).json()
    assert body["reward"] == 0.0 and "FileNotFoundError" in body["metadata"]["errors"]["message"]


@pytest.mark.process
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
@pytest.mark.parametrize("attack", ["socket to the broker", "read /etc/passwd", "read the worker's environment", "fork bomb", "allocate 8 GiB", "infinite loop", "print 100 MB", "new namespaces (seccomp)"])  # fmt: skip
def test_hostile_python_graders_score_zero_through_the_api(
    api: Api, attack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.grading.test_sandbox import ATTACKS, grader

    monkeypatch.setenv("GRPO_SANDBOX_CALL_TIMEOUT_S", "2")
    monkeypatch.setenv("GRPO_SANDBOX_CPU_S", "1")
    monkeypatch.setenv("GRPO_SANDBOX_MEMORY_MB", "256")
    monkeypatch.setenv("GRPO_DATABASE_URL", "postgresql://user:hunter2@db/grpo")
    response = run(api, {"type": "python", "source": grader(ATTACKS[attack])}, "a", {"answer": "a"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["reward"] == 0.0, body
    assert body["metadata"]["errors"]["failure"] in ("error", "timeout")
    assert body["metadata"]["errors"]["message"]
    assert "hunter2" not in response.text


# A pathological answer for sympy: expanding it takes minutes (math-verify's own 5 s alarm
# used to stop it and answer "not equal").
SLOW_MATH = "$(x+y+1)^{200}$"


@pytest.mark.timeout(120, method="thread")
def test_a_math_check_past_its_time_limit_is_reported_as_a_timeout(api: Api) -> None:
    grader = {"type": "math", "timeout_s": 1}
    started = time.monotonic()
    body = run(api, grader, SLOW_MATH, {"answer": "1"}).json()
    assert body["reward"] == 0.0
    assert body["metadata"]["errors"]["failure"] == "timeout", body
    assert "time limit (1 s)" in body["metadata"]["errors"]["message"]
    assert time.monotonic() - started < 60  # the check was stopped, not waited for
    fine = run(api, grader, "so \\boxed{2/4}", {"answer": "\\frac{1}{2}"}).json()
    assert fine["reward"] == 1.0 and fine["metadata"]["errors"]["failure"] is None


def test_a_judge_endpoint_the_operator_did_not_configure_is_refused_when_validated(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "GRPO_JUDGE_ENDPOINTS", json.dumps({"local": {"base_url": "http://127.0.0.1:9/v1"}})
    )
    judge = {
        "type": "score_model",
        "model": "judge",
        "endpoint": "elsewhere",
        "input": [{"role": "user", "content": "Rate {{ sample.output_text }}"}],
        "range": [0, 10],
    }
    nested = {"type": "multi", "graders": {"j": judge}, "calculate_output": "j"}
    for grader, param in [(judge, "grader.endpoint"), (nested, "grader.graders.j.endpoint")]:
        for path in ("/v1/graders/validate", "/v1/graders/run"):
            body = {"grader": grader, "model_sample": "x", "item": {}}
            refused = api.client.post(path, json=body, headers=api.headers)
            assert refused.status_code == 422, (path, refused.text)
            error = refused.json()["error"]
            assert error["param"] == param
            assert "'elsewhere' is not one of this service's (local)" in error["message"]
    known = {**judge, "endpoint": "local"}
    ok = api.client.post("/v1/graders/validate", json={"grader": known}, headers=api.headers)
    assert ok.status_code == 200, ok.text
    # Job creation applies the same rule to the same grader (param under graders[0]).
    job = api.client.post("/v1/jobs", json={**tiny_spec(), "graders": [judge]}, headers=api.headers)
    assert job.status_code == 422 and job.json()["error"]["param"] == "graders[0].endpoint"
