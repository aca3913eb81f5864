"""POST /v1/graders/run under load, on the production shape (Postgres, the real app served by
uvicorn, real HTTP, real bubblewrap sandboxes): python-grader sandboxes are a bounded resource
of the API process, shared fairly between projects. One project's slow graders get answers or
429s with Retry-After; another project's quick ones still get answers; nobody gets a 5xx from a
fork that failed (issue 22, item 2)."""

from __future__ import annotations

import contextlib
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import settings_for, wait_until
from tests.live_server import Server, serve

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

SLOW = "import time\n\ndef grade(sample, item):\n    time.sleep(2)\n    return 0.5"
QUICK = "def grade(sample, item):\n    return 1.0"


@pytest.fixture
def server(pg_url: str, sqlite_dir: Path, queue_name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The real app on Postgres with the default sandbox capacity (read when the app starts)."""

    def start(**sandbox: str) -> Any:
        for name, value in sandbox.items():
            monkeypatch.setenv(f"GRPO_SANDBOX_{name.upper()}", value)
        return serve(settings_for("postgres", pg_url, sqlite_dir, queue_name))

    return start


def grade(server: Server, headers: dict[str, str], source: str) -> tuple[httpx.Response, float]:
    body = {"grader": {"type": "python", "source": source}, "model_sample": "x", "item": {}}
    started = time.monotonic()
    response = httpx.post(f"{server.url}/v1/graders/run", json=body, headers=headers, timeout=60)
    return response, time.monotonic() - started


def test_one_projects_slow_graders_leave_another_projects_quick_ones_answered(
    server: Any,
) -> None:
    """As `grpo api` runs in production: two API processes (here two servers in this process)
    whose sandboxes run as one user under one process limit. Before the capacity existed, up
    to ten grader requests per process (its request slots) started sandboxes at once, bwrap's
    fork failed (BlockingIOError) and the other project's calls got 500s."""
    with contextlib.ExitStack() as stack:
        apis = [stack.enter_context(server()) for _ in range(2)]
        slow_key, quick_key = apis[0].key(), apis[0].key()
        with ThreadPoolExecutor(26) as pool:
            slow = [pool.submit(grade, apis[i % 2], slow_key, SLOW) for i in range(20)]
            quick = [pool.submit(grade, apis[i % 2], quick_key, QUICK) for i in range(6)]
            slow_results = [f.result() for f in slow]
            quick_results = [f.result() for f in quick]
    statuses = [r.status_code for r, _ in slow_results + quick_results]
    assert not [s for s in statuses if s >= 500], [r.text for r, _ in slow_results + quick_results]
    for response, _ in slow_results + quick_results:
        assert response.status_code in (200, 429), response.text
        if response.status_code == 429:
            assert int(response.headers["Retry-After"]) >= 1
            error = response.json()["error"]
            assert error["code"] == "rate_limit_error" and error["param"] == "grader"
            assert "GRPO_SANDBOX_MAX_SANDBOXES_PER_PROJECT" in error["message"]
    answered = [(r.json(), took) for r, took in quick_results if r.status_code == 200]
    assert answered, "the quick project got no answer at all"
    assert all(body["reward"] == 1.0 for body, _ in answered)
    graded = [r.json() for r, _ in slow_results if r.status_code == 200]
    assert graded and all(body["reward"] == 0.5 for body in graded)
    for api in apis:
        assert api.app.state.grpo.sandboxes.full() is False  # every slot given back
    print(  # the measurement the report quotes (pytest -s)
        f"slow: {len(graded)} answered, {20 - len(graded)} x 429; quick: {len(answered)} "
        f"answered in at most {max(t for _, t in answered):.2f} s, "
        f"{6 - len(answered)} x 429"
    )


def test_the_process_limit_is_a_503_and_the_projects_a_429_each_naming_it(server: Any) -> None:
    with server(max_sandboxes="1", max_sandboxes_per_project="1", queue_timeout_s="0.5") as api:
        first, other = api.key(), api.key()
        with ThreadPoolExecutor(3) as pool:
            holding = pool.submit(grade, api, first, SLOW.replace("sleep(2)", "sleep(4)"))
            sandboxes = api.app.state.grpo.sandboxes
            wait_until(sandboxes.full, 30, "the slow grader to hold the only sandbox", 0.02)
            own = pool.submit(grade, api, first, QUICK).result()[0]
            theirs = pool.submit(grade, api, other, QUICK).result()[0]
            assert holding.result()[0].status_code == 200
    assert own.status_code == 429, own.text
    assert own.headers["Retry-After"] == "5"  # one call's time limit (GRPO_SANDBOX_CALL_TIMEOUT_S)
    assert "GRPO_SANDBOX_MAX_SANDBOXES_PER_PROJECT=1" in own.json()["error"]["message"]
    assert theirs.status_code == 503, theirs.text
    assert theirs.headers["Retry-After"] == "5"
    error = theirs.json()["error"]
    assert (
        error["code"] == "capacity_exceeded" and "GRPO_SANDBOX_MAX_SANDBOXES=1" in error["message"]
    )
    assert "GRPO_SANDBOX_QUEUE_TIMEOUT_S" in error["message"]
