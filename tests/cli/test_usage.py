"""Exit codes that need no running service: usage errors (2) and an unreachable API (6)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from grpo_cli.ci_args import Exit
from grpo_cli.client import Client
from grpo_cli.waiting import retrying, stream_patiently
from tests.cli.helpers import cli
from tests.conftest import free_port


@pytest.fixture
def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text("model: tiny-random-llama\n")
    return path


@pytest.mark.parametrize(
    "argv",
    [
        ["submit"],
        ["submit", "s.yaml", "--timeout", "soon"],
        ["submit", "s.yaml", "--timeout", "0s"],
        ["submit", "s.yaml", "--require", "reward/mean=>0.5"],
        ["submit", "s.yaml", "--idempotency-key", "k", "--no-idempotency-key"],
        ["jobs"],
        ["jobs", "list", "--status", "done"],
        ["logs"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    result = cli(*argv)
    assert result.code == Exit.USAGE == 2
    assert "usage: grpo" in result.err


def test_help_documents_the_exit_codes() -> None:
    result = cli("submit", "--help")
    assert result.code == 0
    for line in ("0  succeeded", "3  the job failed", "4  the job succeeded but", "5  --timeout"):
        assert line in result.out


def test_unreadable_spec_or_no_key_exit_2(
    tmp_path: Path, spec: Path, closed_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GRPO_API_KEY", raising=False)
    monkeypatch.setenv("GRPO_DATA_DIR", str(tmp_path / "nothing-here"))
    missing = cli("submit", str(tmp_path / "nope.yaml"), "--api-url", closed_url, "--api-key", "k")
    assert missing.code == 2 and "cannot read spec" in missing.err
    no_key = cli("submit", str(spec), "--api-url", closed_url, "--json")
    assert no_key.code == 2
    assert no_key.json() == {"error": no_key.err.strip().removeprefix("error: "), "exit_code": 2}


@pytest.mark.parametrize(
    "argv",
    [
        ["jobs", "list"],
        ["jobs", "show", "job_x"],
        ["jobs", "cancel", "job_x"],
        ["logs", "job_x"],
        ["metrics", "job_x", "--csv"],
        ["submit", "SPEC", "--no-idempotency-key"],
    ],
)
def test_an_unreachable_api_exits_6(argv: list[str], closed_url: str, spec: Path) -> None:
    argv = [str(spec) if a == "SPEC" else a for a in argv]
    started = time.monotonic()
    result = cli(*argv, "--api-url", closed_url, "--api-key", "k", "--retry-for", "1s")
    assert result.code == Exit.UNAVAILABLE == 6, result
    assert time.monotonic() - started < 5  # retried for about --retry-for, then gave up
    assert f"cannot reach the API at {closed_url}" in result.err


def test_transient_errors_are_retried_for_a_while(closed_url: str) -> None:
    calls: list[float] = []
    with Client(closed_url, "k") as client:

        def call() -> object:
            calls.append(time.monotonic())
            return client.get_job("job_x")

        with pytest.raises(httpx.ConnectError):
            retrying(1.0, call)
        assert len(calls) >= 3  # 0.25 s, 0.5 s ... until the grace is spent
        assert calls[-1] - calls[0] <= 1.0
        started = time.monotonic()
        with pytest.raises(ConnectionError):
            next(stream_patiently(client, "job_x", grace_s=1.0, max_reconnects=0))
        assert 1.0 <= time.monotonic() - started < 5


def test_the_client_commands_import_neither_the_service_nor_torch() -> None:
    """`pip install grpo-service` without extras is enough for CI runners."""
    code = (
        "import sys; from grpo_cli.main import _parser; import grpo_cli.ci; _parser(); "
        "heavy = {'app', 'worker', 'trainer', 'fastapi', 'sqlalchemy', 'celery', 'torch'}; "
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_409_is_retried_only_when_it_is_a_race() -> None:
    from grpo_cli.client import ApiError
    from grpo_cli.waiting import is_transient

    def conflict(kind: str) -> ApiError:
        return ApiError(409, {"error": {"type": kind, "message": "m", "param": "job_id"}})

    assert is_transient(conflict("conflict"))  # a job changing state: try again
    assert not is_transient(conflict("invalid_state"))  # ended: asking again cannot help


def test_the_clients_status_choices_are_the_apis() -> None:
    from app.core.job_status import JobStatus
    from grpo_cli.ci_args import JOB_STATUSES

    assert sorted(JOB_STATUSES) == sorted(s.value for s in JobStatus)
