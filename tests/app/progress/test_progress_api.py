"""Metrics, samples (an agent episode's with its transcript), checkpoints and the SSE stream, fed
by the worker's real database callbacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.jobs import transitions
from app.jobs.transitions import JobStatus
from app.progress import repository as progress_repo
from tests.conftest import Api, tiny_spec
from trainer.agents.episode import Episode
from trainer.agents.samples import sample_transcript
from trainer.run.callbacks import CompletionSample, RolloutSample, RunInfo
from worker.context import WorkerContext
from worker.lease import LeaseKeeper
from worker.progress import DatabaseCallbacks
from worker.settings import build_worker_settings


class _NoDispatch:
    def send(self, job_id: str, queue: str | None = None) -> bool:
        return True


def running_job(api: Api) -> tuple[str, DatabaseCallbacks, WorkerContext]:
    job_id = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers).json()["id"]
    ws = build_worker_settings(
        data_dir=api.settings.data_dir,
        database_url=api.settings.resolved_database_url,
        broker_url=api.settings.resolved_broker_url,
    )
    ctx = WorkerContext(
        ws, make_session_factory(make_engine(ws.resolved_database_url)), _NoDispatch()
    )
    from app.core.live import TailPublisher

    ctx.tail = TailPublisher(ws.resolved_redis_url)
    with session_scope(ctx.sessions) as session:
        attempt = transitions.claim(session, job_id, "test-worker")
    assert attempt == 1
    lease = LeaseKeeper(ctx.sessions, job_id, attempt, interval_s=60)
    callbacks = DatabaseCallbacks(ctx, job_id, attempt, lease)
    callbacks.on_start(RunInfo(10, 0, Path("/m"), Path("/o"), "cpu", "vllm"))
    return job_id, callbacks, ctx


def finish(ctx: WorkerContext, job_id: str) -> None:
    with session_scope(ctx.sessions) as session:
        transitions.transition(session, job_id, JobStatus.SUCCEEDED, attempt=1)


def test_metrics_select_names_ranges_and_downsample(api: Api) -> None:
    job_id, callbacks, _ = running_job(api)
    for step in range(1, 11):
        callbacks.on_step(
            step,
            {"reward/mean": step / 10, "kl": 0.01 * step, "spike": 100.0 if step == 7 else 1.0},
        )
    url = f"/v1/jobs/{job_id}/metrics"
    full = api.client.get(url, headers=api.headers).json()
    assert full["steps"] == 10
    assert full["available"] == ["kl", "reward/mean", "spike"]
    assert [p["step"] for p in full["series"]["reward/mean"]] == list(range(1, 11))
    some = api.client.get(
        url, params={"names": "kl", "step_from": 3, "step_to": 5}, headers=api.headers
    ).json()
    assert list(some["series"]) == ["kl"]
    assert [p["step"] for p in some["series"]["kl"]] == [3, 4, 5]
    small = api.client.get(
        url, params={"names": "spike", "max_points": 3}, headers=api.headers
    ).json()
    points = small["series"]["spike"]
    assert len(points) <= 3
    assert max(p["max"] for p in points) == 100.0  # the spike survives downsampling
    assert sum(p["count"] for p in points) == 10
    bucket = next(p for p in points if p["max"] == 100.0)
    assert bucket["min"] == 1.0 and 1.0 < bucket["value"] < 100.0
    bad = api.client.get(url, params={"step_from": 5, "step_to": 2}, headers=api.headers)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "step_from"
    job = api.client.get(f"/v1/jobs/{job_id}", headers=api.headers).json()
    assert job["progress"]["step"] == 10 and job["progress"]["last_metrics"]["reward/mean"] == 1.0
    assert job["progress"]["heartbeat_age_s"] is not None


def test_samples_and_checkpoints(api: Api, tmp_path: Path) -> None:
    job_id, callbacks, _ = running_job(api)
    group = RolloutSample(
        prompt="What is 2+2?",
        answer="4",
        completions=[CompletionSample("4", 1.0, {"numeric_match": 1.0}, 0.9, 2, "stop")],
    )
    callbacks.on_samples(1, [group, group, group])
    callbacks.on_checkpoint(1, tmp_path / "checkpoint-000001")
    samples = api.client.get(f"/v1/jobs/{job_id}/samples", headers=api.headers).json()
    assert len(samples["data"]) == 1
    assert samples["data"][0]["groups"][0]["completions"][0]["advantage"] == 0.9
    # The trainer bounds the groups per step (sample_groups_per_step); the worker stores them all.
    assert len(samples["data"][0]["groups"]) == 3
    checkpoints = api.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=api.headers).json()
    assert [c["step"] for c in checkpoints["data"]] == [1]


def test_agent_samples_return_each_episode_transcript(api: Api) -> None:
    job_id, callbacks, ctx = running_job(api)
    episode = Episode.start(0, {}, [{"role": "user", "content": "What is 12*34?"}], [1, 2])
    episode.log += [
        {"source": "environment", "role": "user", "content": "Use the tool."},
        {
            "source": "model",
            "role": "assistant",
            "content": "Computing.",
            "tool_calls": [{"name": "multiply", "arguments": {"a": 12, "b": 34}}],
            "malformed": [],
        },
        {"source": "tool", "role": "tool", "name": "multiply", "content": "408", "error": None},
        {"source": "model", "role": "assistant", "content": "408", "tool_calls": []},
    ]
    episode.end("done")
    transcript = sample_transcript(episode)
    agent = RolloutSample(
        prompt="What is 12*34?",
        answer="408",
        completions=[CompletionSample("408", 1.0, {"m": 1.0}, 0.5, 9, "stop", transcript)],
    )
    single = RolloutSample("2+2?", "4", [CompletionSample("4", 1.0, {"m": 1.0}, 0.0, 2, "stop")])
    callbacks.on_samples(1, [agent, single])
    with session_scope(ctx.sessions) as session:  # a row stored before transcripts existed
        old = {"text": "4", "reward": 1.0, "rewards": {}, "advantage": 0.0, "num_tokens": 2,
               "finish_reason": "stop"}  # fmt: skip
        progress_repo.add_samples_once(
            session,
            job_id=job_id,
            step=2,
            attempt=1,
            data=[{"prompt": "p", "answer": None, "completions": [old]}],
            now=utcnow(),
        )
    body = api.client.get(f"/v1/jobs/{job_id}/samples", headers=api.headers).json()
    (first, second) = body["data"]
    agent_out, single_out = first["groups"]
    none = {"name": None, "error": None, "tool_calls": [], "malformed": [], "content_cut": 0}
    assert agent_out["completions"][0]["transcript"] == {
        "end_reason": "done",
        "end_detail": None,
        "turns": [
            {**none, "source": "environment", "role": "user", "content": "Use the tool."},
            {
                **none,
                "source": "model",
                "role": "assistant",
                "content": "Computing.",
                "tool_calls": [
                    {"name": "multiply", "arguments": '{"a": 12, "b": 34}', "arguments_cut": 0}
                ],
            },
            {**none, "source": "tool", "role": "tool", "name": "multiply", "content": "408"},
            {**none, "source": "model", "role": "assistant", "content": "408"},
        ],
        "turns_left_out": 0,
    }
    assert single_out["completions"][0]["transcript"] is None
    assert second["groups"][0]["completions"][0]["transcript"] is None
    # The published schema describes the transcript's turns.
    schemas = api.client.get("/openapi.json").json()["components"]["schemas"]
    turn = schemas["SampleTurn"]["properties"]
    assert turn["source"]["enum"] == ["model", "tool", "environment"]
    assert schemas["SampleTranscript"]["properties"]["turns"]["items"] == {
        "$ref": "#/components/schemas/SampleTurn"
    }


def read_sse(
    api: Api, job_id: str, last_event_id: str | None = None, stop_after_metrics: int | None = None
):  # type: ignore[no-untyped-def]
    headers = dict(api.headers)
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    messages: list[dict[str, object]] = []
    comments = 0
    with api.client.stream("GET", f"/v1/jobs/{job_id}/stream", headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        current: dict[str, object] = {}
        for line in response.iter_lines():
            if line.startswith(":"):
                comments += 1
            elif line.startswith("id: "):
                current["id"] = line[4:]
            elif line.startswith("event: "):
                current["event"] = line[7:]
            elif line.startswith("data: "):
                current["data"] = json.loads(line[6:])
            elif line == "" and current:
                messages.append(current)
                current = {}
                if current == {} and messages[-1].get("event") == "end":
                    break
                metrics = [m for m in messages if m.get("event") == "metrics"]
                if stop_after_metrics is not None and len(metrics) >= stop_after_metrics:
                    break
    return messages, comments


def test_sse_delivers_every_step_in_order_and_resumes_without_gap(api: Api) -> None:
    job_id, callbacks, ctx = running_job(api)
    for step in range(1, 7):
        callbacks.on_step(step, {"reward/mean": float(step)})
    first, _ = read_sse(api, job_id, stop_after_metrics=3)
    steps = [m["data"]["step"] for m in first if m.get("event") == "metrics"]  # type: ignore[index]
    assert steps == [1, 2, 3]
    resume_from = str(next(m for m in reversed(first) if m.get("event") == "metrics")["id"])
    for step in range(7, 10):
        callbacks.on_step(step, {"reward/mean": float(step)})
    finish(ctx, job_id)
    rest, _ = read_sse(api, job_id, last_event_id=resume_from)
    steps_after = [m["data"]["step"] for m in rest if m.get("event") == "metrics"]  # type: ignore[index]
    assert steps_after == [4, 5, 6, 7, 8, 9]  # k+1.. with no gap and no duplicate
    statuses = [m["data"]["data"]["to"] for m in rest if m.get("event") == "status"]  # type: ignore[index]
    assert statuses[-1] == "succeeded"
    assert rest[-1]["event"] == "end"
    # the same stream from the start has everything exactly once
    everything, _ = read_sse(api, job_id)
    assert [m["data"]["step"] for m in everything if m.get("event") == "metrics"] == list(
        range(1, 10)
    )  # type: ignore[index]
    ids = [m["id"] for m in everything if "id" in m]
    assert len(ids) == len(set(ids))


def test_sse_sends_heartbeats_while_idle(api: Api) -> None:
    api.settings.sse_heartbeat_seconds = 0.3
    api.settings.sse_poll_seconds = 0.1
    job_id, callbacks, ctx = running_job(api)
    callbacks.on_step(1, {"reward/mean": 1.0})
    import threading

    def last_step_then_finish() -> None:
        callbacks.on_step(2, {"reward/mean": 2.0})
        finish(ctx, job_id)

    timer = threading.Timer(1.5, last_step_then_finish)
    timer.start()
    messages, comments = read_sse(api, job_id)
    timer.join()
    assert comments >= 2
    assert [m["data"]["step"] for m in messages if m.get("event") == "metrics"] == [1, 2]  # type: ignore[index]


@pytest.mark.parametrize(
    "cursor",
    [
        "nonsense",
        "-1.0",
        "3.-1",
        "99999999999999999999.0",  # past BIGINT: was a 200, then "bigint out of range"
        "1.99999999999999999999",
        f"1.{2**31}",  # past INTEGER, the steps' column
        "1." + "9" * 40,
        "\u00b2.1",  # a digit to str.isdigit, not to int()
        "1.2.3",
        "1",
    ],
)
def test_bad_last_event_id_is_400_before_the_stream_starts(api: Api, cursor: str) -> None:
    job_id = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers).json()["id"]
    ways: list[dict[str, dict[str, str]]] = [{"params": {"after": cursor}}]
    if cursor.isascii():  # a header is Latin-1 on the wire; the query carries any text
        ways.append({"headers": {"Last-Event-ID": cursor}})
    for how in ways:
        response = api.client.get(
            f"/v1/jobs/{job_id}/stream",
            headers=api.headers | how.get("headers", {}),
            params=how.get("params"),
        )
        assert response.status_code == 400, (cursor, response.text)
        assert response.json()["error"]["param"] == "Last-Event-ID"
    # A status the published schema lists for the stream (it did not).
    schema = api.client.get("/openapi.json").json()
    assert "400" in schema["paths"]["/v1/jobs/{job_id}/stream"]["get"]["responses"]


def test_the_largest_cursor_a_column_holds_is_accepted(api: Api) -> None:
    job_id = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers).json()["id"]
    api.client.post(f"/v1/jobs/{job_id}/cancel", headers=api.headers)
    # Nothing is newer than the cursor, so the stream sends only the job's end.
    messages, _ = read_sse(api, job_id, last_event_id=f"{2**63 - 1}.{2**31 - 1}")
    assert [(m["event"], m["data"]["status"]) for m in messages] == [("end", "cancelled")]  # type: ignore[index]
