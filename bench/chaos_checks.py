"""The invariants a chaos run must keep, checked on the rows the database ends up with.

Pure functions over plain rows (dicts read straight from Postgres by `bench.chaos`, or built by
hand in tests/bench/test_chaos_checks.py), so the checker itself can be shown to fail:

- every job ended `succeeded`; a job the run cancelled ended `cancelled` (or `succeeded`, when
  the cancel came as its last step finished); nothing else: no job lost, failed or stuck;
- exactly one metrics row per step: steps 1..N each once for a finished job, 1..k without a gap
  for a cancelled one;
- one attempt at a time: each attempt's lease runs from its claim (`queued -> running`) to the
  status event that ends it, attempts never overlap and are numbered 1, 2, 3... in order;
- every row a worker wrote (metrics, checkpoints, its events) carries an attempt whose lease was
  held when the row was written, so no step was trained (or recorded) by an attempt that had
  lost its lease;
- events are in order: ids increase with `created_at` within a job, the first is `created`, and
  the status events form one chain (each one leaves the status the previous one entered) of
  changes the state machine allows;
- per job kind (bench.chaos_jobs), every metrics row shows the job ran as its kind asked: an
  async job's `async/staleness_max` is exactly min(step - 1, K) at every step (versions are
  fixed by the step, so a restarted rollout server or a resumed attempt changes nothing); a
  two-device job's rows carry rank 1's step time (two ranks trained it); an agent job's
  carry its episodes' turns.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from typing import Any

from app.jobs.transitions import ALLOWED, JobStatus

Row = Mapping[str, Any]
LEASED = frozenset({JobStatus.RUNNING.value, JobStatus.CANCELLING.value})
STALENESS = "async/staleness_max"
SERVER_RESTARTS = "rollout/server_restarts"
# The metric each kind's rows must carry (the metrics rows' `values`, only these read).
KIND_METRICS = {"async": STALENESS, "two_device": "rank/1/time_step", "agent": "episode/turns"}
READ_METRICS = (*KIND_METRICS.values(), SERVER_RESTARTS)
ASYNC_MAX_STALENESS = 1  # bench.chaos_jobs.ASYNC


def metric_values_sql() -> str:
    """The SQL expression of a metrics row's values the checks read (not the whole row)."""
    pairs = ", ".join(f"'{name}', m.\"values\"->'{name}'" for name in READ_METRICS)
    return f"json_build_object({pairs})"


@dataclass(frozen=True)
class Violation:
    job_id: str
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.job_id}: {self.kind}: {self.detail}"


@dataclass(frozen=True)
class Lease:
    """One attempt's hold on a job: from its claim to the event that ended it (None: still
    held when the rows were read)."""

    attempt: int
    start: datetime
    start_event: int
    end: datetime | None = None


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    lost: int = 0  # jobs that did not end as they should (stuck, failed, missing steps)
    duplicated: int = 0  # metrics rows beyond the first for a (job, step)
    statuses: dict[str, int] = field(default_factory=dict)
    statuses_by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    attempts: dict[int, int] = field(default_factory=dict)  # attempts used -> jobs
    # Rollout server restarts the async jobs' metrics report (summed over jobs and attempts).
    server_restarts: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations


def _by_job(rows: Iterable[Row]) -> dict[str, list[Row]]:
    grouped: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        grouped[str(row["job_id"])].append(row)
    return grouped


def _is_status(event: Row) -> bool:
    return event["type"] == "status"


def check_final_status(job: Row, cancelled: set[str]) -> list[Violation]:
    allowed = {"succeeded", "cancelled"} if job["id"] in cancelled else {"succeeded"}
    if job["status"] in allowed:
        return []
    return [Violation(job["id"], "final_status", f"ended {job['status']}, expected {allowed}")]


def check_steps(job: Row, metrics: list[Row]) -> tuple[list[Violation], int]:
    """One metrics row per step, no gap; returns the violations and the duplicate count."""
    counts = Counter(int(m["step"]) for m in metrics)
    duplicated = sum(n - 1 for n in counts.values())
    out: list[Violation] = []
    if duplicated:
        twice = sorted(s for s, n in counts.items() if n > 1)
        out.append(Violation(job["id"], "duplicate_step", f"steps written twice: {twice[:10]}"))
    steps = sorted(counts)
    if job["status"] == "succeeded":
        expected = list(range(1, int(job["total_steps"]) + 1))
        if steps != expected:
            missing = sorted(set(expected) - set(steps))
            extra = sorted(set(steps) - set(expected))
            out.append(
                Violation(job["id"], "steps", f"missing {missing[:10]}, unexpected {extra[:10]}")
            )
    elif steps != list(range(1, len(steps) + 1)):
        out.append(Violation(job["id"], "steps", f"gap in the steps written: {steps[:20]}"))
    return out, duplicated


def check_kind_metrics(job: Row, kind: str, metrics: list[Row]) -> list[Violation]:
    """Every metrics row shows the job ran as `kind` asked (see the module doc)."""
    name = KIND_METRICS.get(kind)
    if name is None:
        return []
    out: list[Violation] = []
    wrong: list[str] = []
    for row in sorted(metrics, key=lambda m: int(m["step"])):
        value = (row.get("values") or {}).get(name)
        step = int(row["step"])
        if value is None:
            wrong.append(f"step {step}: no {name}")
        elif kind == "async" and float(value) != min(step - 1, ASYNC_MAX_STALENESS):
            wrong.append(f"step {step}: {name} {value}")
    if wrong:
        out.append(Violation(job["id"], f"{kind}_metrics", "; ".join(wrong[:10])))
    return out


def server_restarts(metrics: list[Row]) -> int:
    """The rollout server restarts of a job: the counter is per attempt (its last value)."""
    last: dict[int, float] = {}
    for row in metrics:
        value = (row.get("values") or {}).get(SERVER_RESTARTS)
        if value is not None:
            attempt = int(row["attempt"])
            last[attempt] = max(last.get(attempt, 0.0), float(value))
    return int(sum(last.values()))


def check_event_order(job_id: str, events: list[Row]) -> list[Violation]:
    """Ids increase with created_at; `created` first; one allowed chain of status changes."""
    out: list[Violation] = []
    ordered = sorted(events, key=lambda e: int(e["id"]))
    for before, after in pairwise(ordered):
        if after["created_at"] < before["created_at"]:
            out.append(
                Violation(
                    job_id,
                    "event_order",
                    f"event {after['id']} ({after['type']}) is older than event {before['id']}",
                )
            )
    if not ordered or ordered[0]["type"] != "created":
        out.append(Violation(job_id, "event_order", "the first event is not `created`"))
    status = JobStatus.QUEUED.value
    for event in filter(_is_status, ordered):
        data = event.get("data") or {}
        source, target = data.get("from"), data.get("to")
        if source != status:
            out.append(
                Violation(
                    job_id,
                    "transition",
                    f"event {event['id']} leaves {source} but the job was {status}",
                )
            )
        elif target not in {s.value for s in ALLOWED[JobStatus(source)]}:
            out.append(
                Violation(job_id, "transition", f"event {event['id']}: {source} -> {target}")
            )
        status = str(target)
    return out


def leases(job_id: str, events: list[Row]) -> tuple[list[Lease], list[Violation]]:
    """Each attempt's lease from the status events, and the violations of one-at-a-time."""
    out: list[Violation] = []
    found: list[Lease] = []
    current: Lease | None = None
    for event in sorted(filter(_is_status, events), key=lambda e: int(e["id"])):
        data = event.get("data") or {}
        source, target = data.get("from"), data.get("to")
        if target == JobStatus.RUNNING.value:
            attempt = int(event["attempt"])
            if current is not None:
                out.append(
                    Violation(
                        job_id,
                        "overlapping_attempts",
                        f"attempt {attempt} claimed at event {event['id']} while attempt "
                        f"{current.attempt} still held the lease",
                    )
                )
                found.append(
                    Lease(current.attempt, current.start, current.start_event, event["created_at"])
                )
            expected = (found[-1].attempt + 1) if found else 1
            if attempt != expected:
                out.append(
                    Violation(job_id, "attempts", f"attempt {attempt} claimed after {expected - 1}")
                )
            current = Lease(attempt, event["created_at"], int(event["id"]))
        elif source in LEASED and target not in LEASED and current is not None:
            found.append(
                Lease(current.attempt, current.start, current.start_event, event["created_at"])
            )
            current = None
    if current is not None:
        found.append(current)
    return found, out


def check_writes_in_lease(
    job_id: str, held: list[Lease], writes: Iterable[tuple[str, Row]]
) -> list[Violation]:
    """Every worker write (what, row) must fall inside the lease of the attempt it carries."""
    by_attempt = {lease.attempt: lease for lease in held}
    out: list[Violation] = []
    for what, row in writes:
        attempt = int(row["attempt"])
        lease = by_attempt.get(attempt)
        at = row["created_at"]
        inside = lease is not None and lease.start <= at and (lease.end is None or at <= lease.end)
        if not inside:
            where = f"step {row['step']}" if "step" in row else f"event {row.get('id')}"
            out.append(
                Violation(
                    job_id,
                    "write_outside_lease",
                    f"{what} {where} by attempt {attempt} at {at}, outside its lease",
                )
            )
    return out


def check_run(
    jobs: Sequence[Row],
    events: Sequence[Row],
    metrics: Sequence[Row],
    checkpoints: Iterable[Row] = (),
    cancelled: Iterable[str] = (),
    kinds: Mapping[str, str] | None = None,
) -> Report:
    """Every invariant over every job; `cancelled` are the jobs the run asked to cancel,
    `kinds` each job's kind (bench.chaos_jobs; unnamed jobs are `tiny`)."""
    cancelled_ids = set(cancelled)
    kinds = kinds or {}
    events_of, metrics_of, checkpoints_of = _by_job(events), _by_job(metrics), _by_job(checkpoints)
    report = Report()
    for job in jobs:
        job_id = str(job["id"])
        report.statuses[job["status"]] = report.statuses.get(job["status"], 0) + 1
        kind = kinds.get(job_id, "tiny")
        by_kind = report.statuses_by_kind.setdefault(kind, {})
        by_kind[job["status"]] = by_kind.get(job["status"], 0) + 1
        job_events = events_of.get(job_id, [])
        job_metrics = metrics_of.get(job_id, [])
        final = check_final_status(job, cancelled_ids)
        steps, duplicated = check_steps(job, job_metrics)
        if kind == "async":
            report.server_restarts += server_restarts(job_metrics)
        report.duplicated += duplicated
        if final or any(v.kind == "steps" for v in steps):
            report.lost += 1
        held, overlaps = leases(job_id, job_events)
        report.attempts[len(held)] = report.attempts.get(len(held), 0) + 1
        worker_writes: list[tuple[str, Row]] = [("metrics", m) for m in metrics_of.get(job_id, [])]
        worker_writes += [("checkpoint", c) for c in checkpoints_of.get(job_id, [])]
        worker_writes += [
            ("event", e) for e in job_events if e["type"] not in ("status", "created")
        ]
        report.violations += [
            *final,
            *steps,
            *check_event_order(job_id, job_events),
            *overlaps,
            *check_writes_in_lease(job_id, held, worker_writes),
            *check_kind_metrics(job, kind, job_metrics),
        ]
    return report
