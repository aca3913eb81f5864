"""Async GRPO jobs through the service (Postgres, Redis, a real Celery worker): the job's
rollout server is a process of its own that a kill -9 does not take the job down with, a
pause and resume continues exactly, and the mismatch guard pauses a job with its reason.

Each comparison is against a straight run of the same spec: with a fixed version schedule
and seeded sampling, a restarted server and a resumed job train on exactly the same samples."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import psutil
import pytest

from tests.worker.conftest import WorkerProcess, wait_for
from tests.worker.test_faults import Service, job_spec, service  # noqa: F401  (fixture)

pytestmark = [pytest.mark.process]

STEPS = 24
COMPARED = ("reward/mean", "loss/policy", "grad_norm", "async/staleness_max", "entropy")


def async_spec(steps: int = STEPS, **async_options: object) -> dict[str, object]:
    spec = job_spec(steps=steps, max_new_tokens=24, group_size=4, prompts_per_step=4)
    # A reward the untrained tiny model earns now and then (a 7 in the completion), so that
    # every step has signal and updates: the versions really differ.
    spec["graders"] = [{"type": "regex", "name": "has_seven", "pattern": "7"}]
    spec["grpo"]["async"] = {  # type: ignore[index]
        "max_staleness": 1,
        "server_threads": 1,
        "max_mismatch": 100,
        "max_capped_frac": 1.0,
        **async_options,
    }
    return spec


def series(api: Service, job_id: str) -> dict[str, list[tuple[int, float]]]:
    names = (*COMPARED, "rollout/server_restarts", "mismatch/token_mult_prob_error")
    query = "&".join(f"names={name}" for name in names)
    raw = api.get(f"/v1/jobs/{job_id}/metrics?{query}")["series"]
    return {name: [(p["step"], p["value"]) for p in points] for name, points in raw.items()}  # type: ignore[union-attr]


def rollout_servers(worker: WorkerProcess) -> list[psutil.Process]:
    """The worker's rollout server processes (``python -m trainer.rollout.rollout_server``)."""
    children = psutil.Process(worker.proc.pid).children(recursive=True)
    return [p for p in children if "trainer.rollout.rollout_server" in " ".join(p.cmdline())]


def assert_same_run(
    got: dict[str, list[tuple[int, float]]], want: dict[str, list[tuple[int, float]]]
) -> None:
    for name in COMPARED:
        assert [s for s, _ in got[name]] == [s for s, _ in want[name]], name  # none lost or doubled
        for (step, a), (_, b) in zip(got[name], want[name], strict=True):
            assert a == pytest.approx(b, abs=1e-5), (name, step)


def test_an_async_job_survives_its_rollout_server_killed_and_a_pause(
    service: Service,  # noqa: F811
    start_worker: Callable[..., WorkerProcess],
) -> None:
    worker = start_worker(service.settings)
    straight = service.submit(async_spec())
    service.wait_status(straight, ("succeeded",), 300, worker)
    want = series(service, straight)
    assert [s for s, _ in want["reward/mean"]] == list(range(1, STEPS + 1))
    staleness = dict(want["async/staleness_max"])
    assert staleness[1] == 0.0 and all(staleness[s] == 1.0 for s in range(2, STEPS + 1))
    assert all(v >= 1.0 for _, v in want["mismatch/token_mult_prob_error"])

    # kill -9 of the rollout server while the job runs: restarted, re-synced, same result.
    killed = service.submit(async_spec())
    service.wait_step(killed, 2, 300, worker)
    servers = wait_for(lambda: rollout_servers(worker), 30, "the job's rollout server")
    assert isinstance(servers, list) and len(servers) == 1
    os.kill(servers[0].pid, signal.SIGKILL)
    job = service.wait_status(killed, ("succeeded", "failed"), 300, worker)
    assert job["status"] == "succeeded", (job.get("error"), worker.log_tail())
    assert job["attempt"] == 1  # the job itself never failed over
    got = series(service, killed)
    assert got["rollout/server_restarts"][-1][1] >= 1.0, "the kill landed after the last step"
    assert_same_run(got, want)

    # Pause mid-run, then resume: the batches made ahead came back from the checkpoint.
    paused = service.submit(async_spec())
    service.wait_step(paused, 3, 300, worker)
    response = service.client.post(f"/v1/jobs/{paused}/pause", headers=service.headers)
    assert response.status_code == 200, response.text
    job = service.wait_status(paused, ("paused", "succeeded"), 300, worker)
    if job["status"] == "paused":
        response = service.client.post(f"/v1/jobs/{paused}/resume", headers=service.headers)
        assert response.status_code == 200, response.text
        job = service.wait_status(paused, ("succeeded", "failed"), 300, worker)
    assert job["status"] == "succeeded", job.get("error")
    assert_same_run(series(service, paused), want)
    assert rollout_servers(worker) == []  # no server outlives its job


def test_the_mismatch_guard_pauses_an_async_job_with_its_reason(
    service: Service,  # noqa: F811
    start_worker: Callable[..., WorkerProcess],
) -> None:
    worker = start_worker(service.settings)
    # The guard's share of capped tokens (the mismatch the correction cannot fix): any at all.
    spec = async_spec(steps=6, max_capped_frac=1e-6)
    spec["grpo"]["learning_rate"] = 1e-2  # type: ignore[index]
    job_id = service.submit(spec)
    job = service.wait_status(job_id, ("paused", "succeeded", "failed"), 300, worker)
    assert job["status"] == "paused", (job.get("error"), worker.log_tail())
    events = service.events(job_id)
    paused = [
        e for e in events if e["type"] == "status" and (e["data"] or {}).get("to") == "paused"
    ]  # type: ignore[union-attr]
    assert len(paused) == 1
    assert "mismatch guard" in str(paused[0]["message"])
    assert "capped_frac" in str(paused[0]["message"])


def test_max_staleness_0_trains_as_the_synchronous_job(
    service: Service,  # noqa: F811
    start_worker: Callable[..., WorkerProcess],
) -> None:
    """``grpo.async.max_staleness: 0`` is today's step: the same metrics through the service
    as the job that does not name it."""
    worker = start_worker(service.settings)
    explicit = async_spec(steps=3)
    explicit["grpo"]["async"] = {"max_staleness": 0}  # type: ignore[index]
    default = {**explicit, "grpo": dict(explicit["grpo"])}  # type: ignore[call-overload]
    del default["grpo"]["async"]
    ids = [service.submit(default), service.submit(explicit)]
    for job_id in ids:
        job = service.wait_status(job_id, ("succeeded", "failed"), 300, worker)
        assert job["status"] == "succeeded", job.get("error")
    want, got = (series(service, job_id) for job_id in ids)
    assert not got.get("async/staleness_max") and not got.get("rollout/server_restarts")
    for name in ("reward/mean", "loss/policy", "grad_norm", "entropy"):
        assert [s for s, _ in got[name]] == [1, 2, 3], name  # every step updated
        for (_, a), (_, b) in zip(got[name], want[name], strict=True):
            assert a == pytest.approx(b, abs=1e-6), name


def test_a_server_killed_over_and_over_is_a_retryable_job_failure() -> None:
    """A rollout server that keeps being killed (while it starts, or through the client's
    restarts) hands the job back to the queue, counted against its attempts, as a killed rank
    does; one that exits by itself fails the job with the reason."""
    from trainer.rollout.remote_engine import RolloutServerError, RolloutServerKilled
    from worker.stop_reasons import retryable

    killed = RolloutServerKilled("the rollout server died 3 times during one call")
    assert retryable(killed) is killed and isinstance(killed, RolloutServerError)
    assert retryable(RolloutServerError("it exited with code 1 before it was ready")) is None
