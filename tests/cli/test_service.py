"""The client commands against a real service: `grpo serve` on Postgres + Redis and a real
`grpo worker` process training tiny jobs (tests/cli/conftest.py)."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from app.core.db import make_engine
from app.core.models import Job
from tests.cli.conftest import CliService
from tests.cli.helpers import Result, cli
from tests.conftest import wait_until
from tests.worker.conftest import ROOT

WAIT = ("--wait", "--timeout", "4m", "--poll-interval", "0.3s", "--no-progress")


@dataclass
class Finished:
    """A tiny job submitted with `grpo submit --wait --require` and the commit it was built at."""

    result: Result
    spec: Path
    commit: str

    @property
    def job_id(self) -> str:
        return str(self.result.json()["job"]["id"])


@pytest.fixture(scope="session")
def finished(cli_service: CliService) -> Iterator[Finished]:
    commit = secrets.token_hex(20)
    spec = cli_service.spec_file("cli-ok", steps=2)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GITHUB_SHA", commit)
        env.delenv("GRPO_API_KEY", raising=False)
        result = cli(
            "submit", str(spec), *WAIT, "--require", "reward/mean>=0", "--json",
            "--api-url", cli_service.url, "--api-key", cli_service.key,
        )  # fmt: skip
    assert result.code == 0, (result, cli_service.logs())
    yield Finished(result, spec, commit)


def test_submit_wait_exits_0_when_the_job_succeeds_and_requirements_hold(
    finished: Finished,
) -> None:
    body = finished.result.json()
    assert body["exit_code"] == 0 and body["outcome"] == "succeeded"
    assert body["job"]["status"] == "succeeded"
    assert body["job"]["progress"]["step"] == 2
    assert body["replayed"] is False
    assert body["idempotency_key"].startswith("grpo-cli-")
    [verdict] = body["requirements"]
    assert verdict["metric"] == "reward/mean" and verdict["passed"] is True
    assert verdict["step"] == 2  # the final step's value
    assert 0.0 <= verdict["value"] <= 1.0


def test_a_retried_pipeline_gets_the_same_job(
    finished: Finished, cli_env: CliService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GITHUB_SHA", finished.commit)
    started = time.monotonic()
    again = cli("submit", str(finished.spec), *WAIT, "--json")
    assert again.code == 0, again
    body = again.json()
    assert body["job"]["id"] == finished.job_id
    assert body["replayed"] is True
    assert body["idempotency_key"] == finished.result.json()["idempotency_key"]
    assert time.monotonic() - started < 10, "an ended job is not waited for again"
    # Human output says so too, and no second job was created.
    human = cli("submit", str(finished.spec))
    assert human.code == 0
    assert f"job {finished.job_id} already exists" in human.out
    listed = cli("jobs", "list", "--limit", "100", "--json").json()["data"]
    assert [j["id"] for j in listed if j["name"] == "cli-ok"] == [finished.job_id]


def test_a_requirement_that_does_not_hold_exits_4(
    finished: Finished, cli_env: CliService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GITHUB_SHA", finished.commit)  # the same job, already finished
    result = cli(
        "submit", str(finished.spec), *WAIT,
        "--require", "reward/mean>1.5", "--require", "reward/mean >= 0", "--require", "eval/none>0",
    )  # fmt: skip
    assert result.code == 4, result
    assert "requirements (not met):" in result.out
    assert "FAIL  reward/mean>1.5: reward/mean = " in result.out
    assert "ok    reward/mean>=0" in result.out
    assert "FAIL  eval/none>0: eval/none was never recorded" in result.out
    as_json = cli("submit", str(finished.spec), *WAIT, "--require", "reward/mean>1.5", "--json")
    assert as_json.code == 4
    assert as_json.json()["outcome"] == "requirement_not_met"
    assert as_json.json()["requirements"][0]["passed"] is False


def test_metrics_csv_has_a_row_per_step_and_a_column_per_metric(
    finished: Finished, cli_env: CliService
) -> None:
    result = cli("metrics", finished.job_id, "--csv")
    assert result.code == 0, result
    header, *rows = result.out.strip().splitlines()
    columns = header.split(",")
    assert columns[0] == "step" and "reward/mean" in columns and len(columns) > 5
    assert [r.split(",")[0] for r in rows] == ["1", "2"]
    series = cli("metrics", finished.job_id, "--json").json()["series"]["reward/mean"]
    index = columns.index("reward/mean")
    assert [float(r.split(",")[index]) for r in rows] == [p["value"] for p in series]
    only = cli("metrics", finished.job_id, "--csv", "--name", "reward/std").out.splitlines()
    assert only[0] == "step,reward/std" and len(only) == 3


def test_logs_and_jobs_show_a_finished_job(finished: Finished, cli_env: CliService) -> None:
    logs = cli("logs", finished.job_id)
    assert logs.code == 0, logs
    lines = logs.out.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step")] == ["1/2", "2/2"]
    assert any("[created]" in line for line in lines)
    assert lines[-1] == "end: job succeeded"
    shown = cli("jobs", "show", finished.job_id)
    assert shown.code == 0
    assert "status    succeeded" in shown.out and "step      2/2" in shown.out
    listed = cli("jobs", "list", "--status", "succeeded")
    assert listed.code == 0 and finished.job_id in listed.out


def test_timeout_exits_5_and_a_cancelled_job_exits_3(
    cli_env: CliService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI_COMMIT_SHA", secrets.token_hex(20))
    spec = cli_env.spec_file("cli-long", steps=200)
    timed_out = cli(
        "submit", str(spec), "--timeout", "2s", "--poll-interval", "0.2s", "--cancel-on-timeout"
    )
    assert timed_out.code == 5, timed_out
    assert "timed out after 2s" in timed_out.out and "cancel requested" in timed_out.out
    assert "/200 [" in timed_out.err  # the progress bar, on stderr
    # The retried pipeline finds the same job and reports how it ended.
    again = cli("submit", str(spec), *WAIT, "--json")
    assert again.code == 3, (again, cli_env.logs())
    assert again.json()["job"]["status"] == "cancelled"
    assert again.json()["replayed"] is True
    cancel = cli("jobs", "cancel", again.json()["job"]["id"])  # idempotent
    assert cancel.code == 0 and cancel.out.strip().endswith("cancelled")
    ended = cli("jobs", "resume", again.json()["job"]["id"])  # an ended job does not resume
    assert ended.code == 2 and "409" in ended.err


def test_the_api_refusing_a_request_exits_2(cli_env: CliService, tmp_path: Path) -> None:
    missing = cli("jobs", "show", "job_doesnotexist")
    assert missing.code == 2 and "404" in missing.err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny-random-llama\ngrpo: {kl: {estimator: k9}}\n")
    refused = cli("submit", str(bad), "--json")
    assert refused.code == 2
    assert "422" in refused.json()["error"]
    wrong_key = cli("jobs", "list", "--api-key", "not-a-key")
    assert wrong_key.code == 2 and "401" in wrong_key.err


def _grpo(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_cli", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# Long enough to be mid-run when the server is killed (tiny steps take ~0.2 s when quiet).
FOLLOW_STEPS = 40


def _current_step(service: CliService, job_id: str) -> int:
    """The job's step, read from the database (the API may be down)."""
    engine = make_engine(service.server.settings.resolved_database_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(select(Job.current_step).where(Job.id == job_id)).scalar_one())
    finally:
        engine.dispose()


def test_follow_and_wait_survive_a_server_crash(cli_env: CliService) -> None:
    """Kill -9 the API while `grpo submit --wait` waits and `grpo logs --follow` streams, then
    restart it on the same port. The wait carries on, and the follow loop resumes with
    Last-Event-ID and prints each step and each event exactly once."""
    spec = cli_env.spec_file("cli-follow", steps=FOLLOW_STEPS)
    submit = _grpo("submit", str(spec), "--no-idempotency-key", *WAIT)
    follow: subprocess.Popen[str] | None = None
    lines: list[dict[str, Any]] = []
    try:
        assert submit.stdout is not None
        first = submit.stdout.readline()
        assert first.startswith("submitted job "), (first, submit.stderr)
        job_id = first.split()[2]
        follow = _grpo("logs", job_id, "--follow", "--json")
        assert follow.stdout is not None
        for raw in follow.stdout:
            lines.append(json.loads(raw))
            if lines[-1]["event"] == "metrics":
                break
        # Without --follow, a running job's log stops at what exists now.
        so_far = cli("logs", job_id)
        assert so_far.code == 0, so_far
        printed = [line.split()[1] for line in so_far.out.splitlines() if line.startswith("step")]
        assert printed and printed == [f"{n}/{FOLLOW_STEPS}" for n in range(1, len(printed) + 1)]
        cli_env.server.kill()
        assert follow.poll() is None, "the stream had already ended before the crash"
        assert submit.poll() is None, "the job had already ended before the crash"
        # Keep the API down until the worker has finished a step the dead server never served,
        # so the resumed stream has to catch up on it.
        at_crash = min(_current_step(cli_env, job_id), FOLLOW_STEPS - 1)
        wait_until(
            lambda: _current_step(cli_env, job_id) > at_crash,
            120,
            f"a step after {at_crash} while the API is down",
        )
        crashed_at = len(cli_env.server.log_path.read_text())
        cli_env.server.start()
        # Keep reading through the same buffered reader: communicate() would read the raw pipe
        # and drop lines already sitting in this reader's read-ahead buffer.
        assert follow.stderr is not None
        rest = follow.stdout.read()
        err = follow.stderr.read()
        follow.wait(timeout=180)
        submitted, submit_err = submit.communicate(timeout=180)
    finally:
        for proc in (submit, follow):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert follow.returncode == 0, (err, cli_env.logs())
    assert submit.returncode == 0, (submitted, submit_err)
    assert f"job {job_id} succeeded after {FOLLOW_STEPS}/{FOLLOW_STEPS} steps" in submitted
    lines += [json.loads(line) for line in rest.splitlines()]
    steps = [line["data"]["step"] for line in lines if line["event"] == "metrics"]
    assert steps == list(range(1, FOLLOW_STEPS + 1))
    event_ids = [line["data"]["id"] for line in lines if line["event"] in ("status", "event")]
    assert len(event_ids) == len(set(event_ids)) and event_ids == sorted(event_ids)
    assert lines[-1]["event"] == "end" and lines[-1]["data"]["status"] == "succeeded"
    # The restarted server served the resumed stream: the client really reconnected.
    restarted_log = cli_env.server.log_path.read_text()[crashed_at:]
    assert f"/v1/jobs/{job_id}/stream" in restarted_log
    assert f"/v1/jobs/{job_id} " in restarted_log  # and the waiting submit polled it
