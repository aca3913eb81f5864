"""The score_model grader against a real local HTTP server (a stdlib one in a thread that
answers as scripted), and against a real vLLM OpenAI-compatible server (marked model/process)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from pydantic import TypeAdapter

from grading.endpoints import build_judge_settings
from grading.graders import GraderSet, build_grader
from grading.graders.score_model import JudgeScore, parse_score
from jobspec import GraderSpec
from tests.conftest import free_port

SPEC: TypeAdapter[Any] = TypeAdapter(GraderSpec)


class Scripted:
    """What the fake judge answers, request by request, and what it was asked."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, Any]] = []  # (status, body or "hang")
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.lock = threading.Lock()


@pytest.fixture
def judge(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Scripted, str]]:
    script = Scripted()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with script.lock:
                script.requests.append(body)
                script.headers.append(dict(self.headers))
                status, reply = script.replies.pop(0) if script.replies else (200, "5")
            if reply == "hang":
                time.sleep(3)
                return
            payload = json.dumps({"choices": [{"message": {"content": reply}}]}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test")
    try:
        yield script, f"http://127.0.0.1:{port}/v1"
    finally:
        server.shutdown()
        server.server_close()


def spec(**extra: Any) -> Any:
    return SPEC.validate_python(
        {
            "type": "score_model",
            "name": "judge",
            "model": "judge-model",
            "endpoint": "local",
            "input": [
                {"role": "system", "content": "Score from 0 to 10."},
                {"role": "user", "content": "Q: {{ item.question }}\nA: {{ sample.output_text }}"},
            ],
            "range": [0, 10],
            **extra,
        }
    )


def grader(url: str, **settings: Any) -> JudgeScore:
    built = build_grader(spec())
    assert isinstance(built, JudgeScore)
    endpoints = {"local": {"base_url": url, "api_key_env": "JUDGE_TEST_KEY"}}
    built.settings = build_judge_settings(endpoints=endpoints, **settings)
    return built


def test_parse_score() -> None:
    assert parse_score("I'd give it a 7.") == 7.0
    assert parse_score('{"score": 3}') == 3.0
    assert parse_score("no number") is None


def test_scores_are_mapped_from_the_range_and_the_request_is_rendered(
    judge: tuple[Scripted, str],
) -> None:
    script, url = judge
    script.replies = [(200, "7"), (200, '{"score": 3}')]
    batch = GraderSet([grader(url)]).score_batch(["four", "4"], [{"question": "2+2?"}] * 2)
    assert sorted(batch.totals) == [0.3, 0.7] and batch.errors == {"judge": 0}
    asked = script.requests[0]
    assert asked["model"] == "judge-model" and asked["temperature"] == 0.0
    assert asked["messages"][1]["content"].startswith("Q: 2+2?\nA: ")
    assert script.headers[0]["Authorization"] == "Bearer sk-test"  # from the worker's env


def test_an_endpoint_that_names_its_model_serves_graders_written_for_openai(
    judge: tuple[Scripted, str],
) -> None:
    script, url = judge
    script.replies = [(200, "7")]
    built = build_grader(
        spec(model="gpt-4o-2024-08-06", sampling_params={"reasoning_effort": "low"})
    )
    assert isinstance(built, JudgeScore)
    endpoints = {"local": {"base_url": url, "model": "served-judge"}}
    built.settings = build_judge_settings(endpoints=endpoints)
    GraderSet([built]).score_batch(["4"], [{"question": "2+2?"}])
    assert script.requests[0]["model"] == "served-judge"
    assert script.requests[0]["reasoning_effort"] == "low"


def test_busy_judges_are_retried_and_bad_replies_counted(judge: tuple[Scripted, str]) -> None:
    script, url = judge
    script.replies = [(429, "busy"), (503, "down"), (200, "10")]
    g = grader(url, retries=3)
    assert [x.score for x in g.grade_batch(["a"], [{"question": "q"}])] == [1.0]
    assert len(script.requests) == 3
    script.replies = [(200, "eleven out of ten: 11"), (400, "bad request")]
    g = grader(url, retries=3, concurrency=1)
    graded = g.grade_batch(["a", "b"], [{"question": "q"}] * 2)
    assert [x.failure for x in graded] == ["error", "error"]
    assert g.first_error is not None


def test_a_judge_that_hangs_is_a_timeout(judge: tuple[Scripted, str]) -> None:
    script, url = judge
    script.replies = [(200, "hang")]
    g = grader(url, timeout_s=0.5, retries=0)
    started = time.monotonic()
    (graded,) = g.grade_batch(["a"], [{"question": "q"}])
    assert graded.failure == "timeout" and time.monotonic() - started < 3


def test_an_unconfigured_endpoint_fails_every_sample_with_the_reason() -> None:
    g = build_grader(spec())
    assert isinstance(g, JudgeScore)
    g.settings = build_judge_settings(endpoints={})
    assert [x.failure for x in g.grade_batch(["a", "b"], [{}, {}])] == ["error", "error"]
    assert "not configured" in (g.first_error or "")


def test_a_reply_over_the_limit_is_refused_unread_and_not_retried(
    judge: tuple[Scripted, str],
) -> None:
    """The judge calls through the operator endpoints' one client: the reply is read no further
    than GRPO_JUDGE_MAX_REPLY_BYTES, asked uncompressed (so the bound is on what is parsed)."""
    script, url = judge
    script.replies = [(200, "9" * 4096)]
    g = grader(url, max_reply_bytes=1024, retries=3)
    (graded,) = g.grade_batch(["a"], [{"question": "q"}])
    assert graded.failure == "error" and "over 1024 bytes" in (g.first_error or "")
    assert len(script.requests) == 1  # a bad answer is not retried
    assert script.headers[0]["Accept-Encoding"] == "identity"
