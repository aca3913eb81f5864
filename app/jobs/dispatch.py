"""Sending jobs to their queue, fairly: the one place every sender (create, the sweep, the reaper,
a worker handing a job back, a job's end) goes through, so `dispatched_at` is always right for
the sweep that reads it.

Fair dispatch: a project holds at most `max_per_project` dispatch slots of each size class, a
slot being a job sent to the broker or running. Its other queued jobs wait in the database
(`dispatched_at` is null) and never reach the broker, so one project's backlog cannot fill
every worker: a worker takes messages in order, and the broker holds at most `max_per_project`
of any one project in each queue. Slots are counted per size class (the job's queue) because
only workers of one size take a queue's jobs: a project's jobs that wait for a size no worker
runs (or whose workers are busy) hold that size's slots, never those its other jobs need. A
slot is refilled when a job of the project ends (`job_ended`, run after the commit of that
end) and by the worker's periodic sweep, which serves the projects round-robin, oldest job
first within a project. Every count is taken under the project's row lock, so concurrent
senders (API processes, workers, the sweep) never exceed the cap and never send one job twice.

The cap travels with the session factory (`install`), because the state machine, which ends
jobs, sits below this module and cannot import it; a factory without it sends without a cap.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from app.core import db
from app.core import projects_repository as projects_repo
from app.core.queue import Dispatcher, withdraw
from app.jobs import repository as jobs_repo
from app.jobs import slots_repository as slots_repo
from app.jobs.transitions import ON_JOB_ENDED, JobStatus

_POLICY = "grpo_fair_dispatch"


@dataclass(frozen=True)
class FairDispatch:
    dispatcher: Dispatcher
    max_per_project: int


def install(
    sessions: sessionmaker[Session], dispatcher: Dispatcher, *, max_per_project: int
) -> None:
    """Make every unit of work of `sessions` dispatch within the per-project cap, and refill a
    project's slot (through `dispatcher`) once the end of one of its jobs is committed."""
    policy = FairDispatch(dispatcher, max_per_project)
    info = dict(sessions.kw.get("info") or {})
    info[_POLICY] = policy
    info[ON_JOB_ENDED] = functools.partial(job_ended, policy)
    sessions.configure(info=info)


def _cap(session: Session) -> int | None:
    policy = session.info.get(_POLICY)
    return policy.max_per_project if isinstance(policy, FairDispatch) else None


def send_job(session: Session, dispatcher: Dispatcher, *, job_id: str, queue: str) -> bool:
    """Publish an already committed job to `queue`; on success stamp `dispatched_at` (flushed,
    the caller's boundary commits). False when the broker is unreachable: the job stays queued
    and the sweep tries again."""
    if not dispatcher.send(job_id, queue):
        return False
    jobs_repo.mark_dispatched(session, job_id=job_id)
    return True


def send_after_commit(
    session: Session,
    dispatcher: Dispatcher,
    *,
    job_id: str,
    queue: str,
    created: bool = False,
    slots_held: int | None = None,
) -> None:
    """Send the job once the unit of work that created or re-queued it has committed, if its
    project has a free dispatch slot; otherwise it waits for one in the database.

    A worker must never receive an id it cannot read yet, and a rolled-back job must never be
    sent at all, so the message waits for the boundary's commit (app.core.db.after_commit). `queue`
    is where the job goes (a re-queued job goes back to the queue it was created for).
    `created`: the job was inserted in this unit of work, so it holds no slot yet and there is
    no `dispatched_at` to clear. `slots_held`: the project's dispatch slots of `queue` in use,
    counted under the project's lock that this unit of work holds until its commit."""
    if not created:
        # Until the send, the job holds no slot: a re-queued job gives its old one back, and
        # the sweep may send it instead of us (then we find it sent and do nothing).
        jobs_repo.mark_undispatched(session, job_id=job_id)
    cap = _cap(session)
    if cap is not None and slots_held is not None and slots_held >= cap:
        # The project is at its cap: the job waits, with no look after the commit. A slot that
        # frees after that count is refilled by fill_slots, which takes the project's lock,
        # so it runs after our commit and sees our job.
        return

    def may_send(after: Session) -> str | None:
        """The job's project when the job still waits and its project has a free slot."""
        state = slots_repo.dispatch_state(after, job_id=job_id)
        if state is None or state.status != JobStatus.QUEUED or state.dispatched_at is not None:
            return None  # sent by someone else meanwhile, or no longer queued
        if cap is not None and state.slots_held >= cap:
            return None  # waits for a slot: a job of its project ending, or the sweep
        return str(state.project_id)

    def send(after: Session) -> None:
        # First without the lock: a project at its cap (the usual case of a burst of creates)
        # costs one read and no lock. Leaving the job waiting then is safe: our job is
        # committed, so a slot freed after this read is refilled by the end that freed it
        # (job_ended runs after that end's commit and sees our job), or by the sweep.
        project_id = may_send(after)
        if project_id is None:
            return
        projects_repo.lock(after, project_id=project_id)
        if may_send(after) is None:  # as it is now that we hold the lock
            return
        send_job(after, dispatcher, job_id=job_id, queue=queue)

    db.after_commit(session, send)


def withdraw_after_commit(session: Session, *, job_id: str, queue: str) -> None:
    """Once this unit of work's commit took the job out of `queued` (cancelled, or paused while
    queued), remove its waiting messages from the broker of the installed dispatcher
    (app.core.queue.withdraw): else each waits until a worker takes it only to drop it, and in
    a queue no worker consumes, for good. Best effort: a message left is still harmless."""
    policy = session.info.get(_POLICY)
    if isinstance(policy, FairDispatch):
        dispatcher = policy.dispatcher
        db.after_commit(session, lambda _: withdraw(dispatcher, job_id=job_id, queue=queue))


@dataclass(frozen=True)
class Filled:
    sent: list[str]
    broker_down: bool = False


def fill_slots(
    session: Session, dispatcher: Dispatcher, *, project_id: str, cap: int, limit: int | None = None
) -> Filled:
    """Send the project's oldest waiting jobs into its free dispatch slots, each size class
    into its own (at most `limit` jobs, the oldest first whatever their size). Run on committed
    rows, inside a unit of work of its own: it holds the project's lock until that commits."""
    projects_repo.lock(session, project_id=project_id)
    due: list[tuple[datetime, str, str]] = []
    for queue, held in slots_repo.slots_by_queue(session, project_id=project_id).items():
        free = cap - held if limit is None else min(cap - held, limit)
        if free > 0:
            rows = slots_repo.waiting(session, project_id=project_id, queue=queue, limit=free)
            due += [(created_at, job_id, queue) for job_id, queue, created_at in rows]
    sent: list[str] = []
    for _, job_id, queue in sorted(due)[:limit]:
        if not send_job(session, dispatcher, job_id=job_id, queue=queue):
            return Filled(sent, broker_down=True)
        sent.append(job_id)
    return Filled(sent)


def job_ended(policy: FairDispatch, session: Session, *, job_id: str) -> None:
    """After-commit work of a job's end (installed by `install`): its slot is free, so the
    project's next waiting jobs are sent."""
    row = slots_repo.dispatch_row(session, job_id=job_id)
    if row is not None:
        fill_slots(
            session, policy.dispatcher, project_id=row.project_id, cap=policy.max_per_project
        )
