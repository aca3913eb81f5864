"""The official `openai` package, unchanged, against a live grpo-service (uvicorn on a free port,
Postgres, Redis, a real Celery worker): upload a JSONL of messages rows, create reinforcement
jobs on the tiny model with a string_check and a python grader, poll them to success, page
events and checkpoints with auto_paging_iter, pause, resume and cancel, and get each SDK error
class with its `param`."""

from __future__ import annotations

import json
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.conftest import new_project_key, settings_for
from tests.live_server import Server, serve
from tests.worker.conftest import WorkerProcess, wait_for

pytestmark = [pytest.mark.process, pytest.mark.model]

ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Answer with one digit."},
            {"role": "user", "content": f"say {w}"},
        ],
        "answer": "7",
    }
    for w in "abcdefgh"
]
STRING_CHECK = {
    "type": "string_check",
    "name": "has seven",
    "input": "{{ sample.output_text }}",
    "reference": "7",
    "operation": "like",
}
PYTHON = {
    "type": "python",
    "name": "digit",
    "source": "def grade(sample, item):\n"
    "    return 1.0 if item['answer'] in sample['output_text'] else 0.0\n",
}
# Native settings through the SDK's extra_body: a small, quick job on the tiny model.
EXTENSION = {
    "grpo_service": {
        "grpo": {"max_new_tokens": 8, "max_prompt_tokens": 64},
        "rollout": {"engine": "transformers"},
        "checkpoint_interval": 1,
    }
}
ENDED = ("succeeded", "failed", "cancelled")


@pytest.fixture
def live(
    pg_url: str, sqlite_dir: Path, start_worker: Callable[..., WorkerProcess]
) -> Iterator[tuple[Server, WorkerProcess]]:
    settings = settings_for(
        "postgres", pg_url, sqlite_dir, f"grpo-sdk-{secrets.token_hex(4)}", max_attempts=2
    )
    with serve(settings) as server:
        worker = start_worker(settings)
        yield server, worker


def client_for(server: Server, key: str | None = None, **options: Any) -> OpenAI:
    key = key or new_project_key(server.settings)[0]
    return OpenAI(base_url=f"{server.url}/v1", api_key=key, **options)


def method(grader: dict[str, Any], **hyperparameters: Any) -> Any:
    return {
        "type": "reinforcement",
        "reinforcement": {"grader": grader, "hyperparameters": hyperparameters},
    }


def wait_status(
    client: OpenAI, job_id: str, statuses: tuple[str, ...], worker: WorkerProcess
) -> Any:
    def reached() -> Any:
        job = client.fine_tuning.jobs.retrieve(job_id)
        return job if job.status in statuses else None

    try:
        return wait_for(reached, 300, f"job {job_id} to reach {statuses}")
    except AssertionError:
        raise AssertionError(worker.log_tail()) from None


def test_the_openai_sdk_trains_and_follows_jobs(live: tuple[Server, WorkerProcess]) -> None:
    server, worker = live
    client = client_for(server)
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    file = client.files.create(file=("train.jsonl", content), purpose="fine-tune")
    assert file.object == "file" and file.purpose == "fine-tune" and file.status == "processed"
    assert client.files.retrieve(file.id).bytes == len(content)

    graders: list[dict[str, Any]] = [STRING_CHECK]
    if shutil.which("bwrap") is not None:  # the python grader runs in the bubblewrap sandbox
        graders.append(PYTHON)
    jobs = [
        client.fine_tuning.jobs.create(
            model="tiny-random-llama",
            training_file=file.id,
            method=method(grader, n_epochs=1, batch_size=4, compute_multiplier=0.25),
            suffix=f"sdk-{grader['type']}",
            seed=3,
            metadata={"grader": grader["type"]},
            extra_body=EXTENSION,
        )
        for grader in graders
    ]
    for grader, job in zip(graders, jobs, strict=True):
        assert job.object == "fine_tuning.job" and job.status == "queued"
        done = wait_status(client, job.id, ENDED, worker)
        assert done.status == "succeeded", (done.error, worker.log_tail())
        name = f"ft:tiny-random-llama:sdk-{grader['type']}:{job.id}"
        assert done.fine_tuned_model == name
        assert done.trained_tokens and done.trained_tokens > 0
        assert done.hyperparameters.batch_size == 4 and done.hyperparameters.n_epochs == 1

        # Iterating a page follows `after` cursors page by page (the SDK's auto-pagination).
        first_page = client.fine_tuning.jobs.list_events(job.id, limit=2)
        assert len(list(first_page.iter_pages())) > 1
        events = list(first_page)
        steps = [e.data["step"] for e in events if e.type == "metrics"]
        assert steps == [2, 1]  # 8 rows at 4 a step: 2 steps, newest first
        assert any(e.type == "message" and e.data["type"] == "status" for e in events)
        assert len({e.id for e in events}) == len(events)

        checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id, limit=1))
        assert [c.step_number for c in checkpoints] == [2, 1]
        assert checkpoints[0].fine_tuned_model_checkpoint == f"{done.fine_tuned_model}:ckpt-step-2"

        [result] = done.result_files
        table = client.files.content(result).text.splitlines()
        assert table[0].startswith("step,") and [r.split(",")[0] for r in table[1:]] == ["1", "2"]

    listed = client.fine_tuning.jobs.list(metadata={"grader": "string_check"})
    assert [j.id for j in listed.data] == [jobs[0].id]


def test_pause_resume_and_cancel_through_the_sdk(live: tuple[Server, WorkerProcess]) -> None:
    server, worker = live
    client = client_for(server)
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    file = client.files.create(file=("train.jsonl", content), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="tiny-random-llama",
        training_file=file.id,
        method=method(STRING_CHECK, n_epochs=100, batch_size=2, compute_multiplier=0.25),
        extra_body=EXTENSION,
    )

    def trained_a_step() -> bool:
        return bool(client.fine_tuning.jobs.retrieve(job.id).model_extra["grpo_service"]["step"])

    wait_for(trained_a_step, 300, "the first step")
    client.fine_tuning.jobs.pause(job.id)
    paused = wait_status(client, job.id, ("paused",), worker)
    step = paused.model_extra["grpo_service"]["step"]
    assert client.fine_tuning.jobs.checkpoints.list(job.id).data[0].step_number == step
    assert client.fine_tuning.jobs.resume(job.id).status in ("queued", "running")

    def past(step_seen: int) -> Callable[[], bool]:
        def check() -> bool:
            got = client.fine_tuning.jobs.retrieve(job.id).model_extra["grpo_service"]["step"]
            return bool(got > step_seen)

        return check

    wait_for(past(step), 300, "a step after the resume")
    client.fine_tuning.jobs.cancel(job.id)
    assert wait_status(client, job.id, ENDED, worker).status == "cancelled"
    # A file a live job reads cannot go; once the job ended it can.
    assert client.files.delete(file.id).deleted is True


def test_sdk_error_classes_carry_the_param(
    live: tuple[Server, WorkerProcess], pg_url: str, sqlite_dir: Path
) -> None:
    server, _ = live
    client = client_for(server, max_retries=0)
    file = client.files.create(file=("t.jsonl", json.dumps(ROWS[0]).encode()), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as bad:
        client.fine_tuning.jobs.create(
            model="tiny-random-llama",
            training_file=file.id,
            method={"type": "supervised", "supervised": {}},
        )
    assert bad.value.param == "method.type" and bad.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.fine_tuning.jobs.create(
            model="gpt-9", training_file=file.id, method=method(STRING_CHECK)
        )
    assert unknown.value.param == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.fine_tuning.jobs.retrieve("job_0000000000000000")
    assert missing.value.param == "job_id"
    with pytest.raises(openai.AuthenticationError):
        client_for(server, key="grpo_nope_nope", max_retries=0).fine_tuning.jobs.list()

    # A project at its job quota: RateLimitError (a server whose quota is one active job).
    strict = settings_for(
        "postgres", pg_url, sqlite_dir, f"grpo-sdk-{secrets.token_hex(4)}",
        max_active_jobs_per_project=1,
    )  # fmt: skip
    with serve(strict, _Parked()) as limited:
        busy = client_for(limited, max_retries=0)
        upload = busy.files.create(
            file=("t.jsonl", json.dumps(ROWS[0]).encode()), purpose="fine-tune"
        )
        create = {
            "model": "tiny-random-llama",
            "training_file": upload.id,
            "method": method(STRING_CHECK),
        }
        busy.fine_tuning.jobs.create(**create)
        with pytest.raises(openai.RateLimitError) as limited_error:
            busy.fine_tuning.jobs.create(**create)
        assert limited_error.value.code == "quota_exceeded"
        assert limited_error.value.response.headers["retry-after"]


class _Parked:
    """Jobs stay queued: no worker serves the quota server."""

    def send(self, job_id: str, queue: str | None = None) -> bool:
        return True
