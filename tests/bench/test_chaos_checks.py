"""The chaos run's invariant checker (bench/chaos_checks.py) on hand-made rows: a clean history
passes, and each kind of damage a fault could do is reported, so a green chaos run means the
rows were checked, not that the checker cannot fail."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from bench.chaos_checks import check_run

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class History:
    """The rows of one job, written in order as the service would."""

    def __init__(self, job_id: str = "job_a", total_steps: int = 4) -> None:
        self.job: dict[str, Any] = {"id": job_id, "status": "queued", "total_steps": total_steps}
        self.events: list[dict[str, Any]] = []
        self.metrics: list[dict[str, Any]] = []
        self.checkpoints: list[dict[str, Any]] = []
        self.event("created", 0, 0.0)

    def event(
        self, kind: str, attempt: int, t: float, data: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        row = {
            "id": len(self.events) + 1,
            "job_id": self.job["id"],
            "attempt": attempt,
            "type": kind,
            "data": data,
            "created_at": at(t),
        }
        self.events.append(row)
        return row

    def status(self, source: str, target: str, attempt: int, t: float) -> None:
        self.event("status", attempt, t, {"from": source, "to": target})
        self.job["status"] = target

    def step(self, step: int, attempt: int, t: float) -> None:
        self.metrics.append(
            {"job_id": self.job["id"], "step": step, "attempt": attempt, "created_at": at(t)}
        )

    def check(self, cancelled: tuple[str, ...] = ()) -> list[str]:
        report = check_run(
            [self.job], self.events, self.metrics, self.checkpoints, cancelled=cancelled
        )
        return [v.kind for v in report.violations]


def resumed_history() -> History:
    """Attempt 1 trains steps 1-2 and is lost; the reaper re-queues; attempt 2 resumes."""
    h = History()
    h.status("queued", "running", 1, 1.0)
    h.event("started", 1, 1.1, {"start_step": 0})
    h.step(1, 1, 2.0)
    h.step(2, 1, 3.0)
    h.checkpoints.append({"job_id": "job_a", "step": 2, "attempt": 1, "created_at": at(3.1)})
    h.status("running", "queued", 1, 10.0)  # the reaper: heartbeat stale
    h.status("queued", "running", 2, 11.0)
    h.event("started", 2, 11.1, {"start_step": 2})
    h.step(3, 2, 12.0)
    h.step(4, 2, 13.0)
    h.status("running", "succeeded", 2, 14.0)
    return h


def test_a_clean_resumed_history_passes() -> None:
    h = resumed_history()
    report = check_run([h.job], h.events, h.metrics, h.checkpoints)
    assert report.ok, [str(v) for v in report.violations]
    assert (report.lost, report.duplicated, report.attempts) == (0, 0, {2: 1})


def test_a_step_written_twice_is_a_duplicate() -> None:
    h = resumed_history()
    h.step(2, 2, 12.5)  # attempt 2 repeated step 2 and its row was stored again
    assert "duplicate_step" in h.check()
    report = check_run([h.job], h.events, h.metrics)
    assert report.duplicated == 1


def test_a_missing_step_is_lost() -> None:
    h = resumed_history()
    h.metrics = [m for m in h.metrics if m["step"] != 3]
    assert h.check() == ["steps"]
    assert check_run([h.job], h.events, h.metrics).lost == 1


def test_a_job_that_did_not_succeed_is_reported() -> None:
    h = History()
    h.status("queued", "running", 1, 1.0)
    h.status("running", "failed", 1, 2.0)
    assert "final_status" in h.check()
    stuck = History("job_b")
    assert "final_status" in stuck.check()  # still queued when the run ended


def test_a_cancelled_job_passes_only_when_the_run_cancelled_it() -> None:
    h = History()
    h.status("queued", "running", 1, 1.0)
    h.step(1, 1, 2.0)
    h.status("running", "cancelling", 1, 2.5)
    h.status("cancelling", "cancelled", 1, 3.0)
    assert h.check(cancelled=("job_a",)) == []
    assert h.check() == ["final_status"]


def test_overlapping_attempts_are_detected() -> None:
    h = History()
    h.status("queued", "running", 1, 1.0)
    h.step(1, 1, 2.0)
    # A second claim while attempt 1 still holds the lease (no event ended it).
    h.event("status", 2, 3.0, {"from": "queued", "to": "running"})
    h.step(2, 2, 4.0)
    h.step(3, 1, 4.5)  # attempt 1 still training
    h.step(4, 2, 5.0)
    h.status("running", "succeeded", 2, 6.0)
    kinds = h.check()
    assert "overlapping_attempts" in kinds
    assert "transition" in kinds  # the chain says running, the event says it left queued


def test_a_write_by_an_attempt_that_lost_its_lease_is_detected() -> None:
    h = resumed_history()
    # The paused attempt 1 woke up and wrote step 3 after the reaper took its lease.
    h.metrics = [m for m in h.metrics if m["step"] != 3]
    h.step(3, 1, 11.5)
    assert h.check() == ["write_outside_lease"]


def test_an_event_of_a_stale_attempt_is_detected() -> None:
    h = resumed_history()
    h.event("checkpoint", 1, 15.0, {"step": 3})  # after the job finished under attempt 2
    assert h.check() == ["write_outside_lease"]


def test_out_of_order_events_are_detected() -> None:
    h = resumed_history()
    h.events[3]["created_at"] = at(2.5)  # event 4 (a status change at 10 s) before event 3
    h.events[2]["created_at"] = at(2.6)
    assert "event_order" in h.check()


def test_a_transition_the_state_machine_forbids_is_detected() -> None:
    h = History()
    h.status("queued", "running", 1, 1.0)
    for step in range(1, 5):
        h.step(step, 1, 1.0 + step)
    h.status("running", "succeeded", 1, 6.0)
    h.status("succeeded", "running", 1, 7.0)  # a finished job restarted
    h.job["status"] = "succeeded"
    assert "transition" in h.check()


def test_attempt_numbers_must_follow_one_another() -> None:
    h = History()
    h.status("queued", "running", 2, 1.0)  # attempt 1 never happened
    for step in range(1, 5):
        h.step(step, 2, 1.0 + step)
    h.status("running", "succeeded", 2, 6.0)
    assert h.check() == ["attempts"]
