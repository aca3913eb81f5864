"""A job of a size no worker runs (issue 32, hostile tenant): it is told so at creation (a
warning in the answer and in the dry run, and a `no_worker` event), and it holds dispatch slots
of its own size class only, so the project's other jobs are sent to their workers at once.

Before, a project's two `devices: 2` jobs, with no two-device worker anywhere, held both of its
dispatch slots without a word, and its one-device job sat queued behind them."""

from __future__ import annotations

from collections.abc import Callable

from tests.app.jobs.conftest import Deployment


def test_a_job_of_a_size_no_worker_runs_is_told_so_and_never_holds_up_the_projects_others(
    deployment: Callable[..., Deployment],
) -> None:
    service = deployment()
    service.worker_seen(devices=1)  # the deployment runs one-device workers only

    # Two two-device jobs: as many as the project may have sent at once (the default cap, 2).
    big = [service.create(2) for _ in range(2)]
    for job in big:
        (warning,) = job["warnings"]
        assert "no worker of 2 device(s)" in warning and "GRPO_WORKER_DEVICES=2" in warning
        (event,) = [e for e in service.events(job["id"]) if e["type"] == "no_worker"]
        assert (event["level"], event["message"]) == ("warning", warning)
        assert event["data"] == {"devices": 2}
    dry_run = service.post(2, "/v1/jobs/validate")
    assert dry_run.status_code == 200 and big[0]["warnings"][0] in dry_run.json()["warnings"]

    # The project's one-device job goes to its workers at once: the waiting two-device jobs
    # hold their own size class's slots, not the ones it needs.
    small = service.create(1)
    assert small["warnings"] == [] and service.dispatcher.sent[-1] == small["id"]
    assert service.dispatcher.queues[small["id"]] == service.settings.queue_name
    assert [e["type"] for e in service.events(small["id"])] == ["created"]


def test_nothing_is_said_while_no_worker_was_seen_or_once_one_of_the_size_runs(
    deployment: Callable[..., Deployment],
) -> None:
    service = deployment()
    # No worker seen at all (a fresh start, workers starting after the API): nothing is known.
    assert service.create(2)["warnings"] == []
    service.worker_seen(devices=1)
    assert len(service.create(2)["warnings"]) == 1
    service.worker_seen(devices=2)
    assert service.create(2)["warnings"] == []
    assert service.post(2, "/v1/jobs/validate").json()["warnings"] == []


def test_a_slot_freed_in_one_size_class_goes_to_that_class(
    deployment: Callable[..., Deployment],
) -> None:
    """The refill after a job's end (and the sweep, through the same fill_slots) sends the
    oldest waiting job of a size class that has a free slot, never one whose class is full."""
    service = deployment(max_dispatched_per_project=1)
    one, two = service.create(1)["id"], service.create(2)["id"]  # each class's one slot
    waiting_one, waiting_two = service.create(1)["id"], service.create(2)["id"]
    assert service.dispatcher.sent == [one, two]

    cancelled = service.api.client.post(f"/v1/jobs/{one}/cancel", headers=service.api.headers)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert service.dispatcher.sent == [one, two, waiting_one]
    cancelled = service.api.client.post(f"/v1/jobs/{two}/cancel", headers=service.api.headers)
    assert cancelled.status_code == 200
    assert service.dispatcher.sent == [one, two, waiting_one, waiting_two]
