"""The job state machine: allowed and illegal transitions, fencing, races."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.errors import IllegalTransition
from app.core.ids import new_id
from app.core.models import Job, JobEvent
from app.core.settings import Settings
from app.jobs import transitions
from app.jobs.transitions import JobStatus
from tests.conftest import new_project_key


@pytest.fixture
def sessions(settings: Settings) -> sessionmaker[Session]:
    return make_session_factory(make_engine(settings.resolved_database_url))


def new_job(sessions: sessionmaker[Session], settings: Settings) -> str:
    _, project_id = new_project_key(settings)
    with session_scope(sessions) as session:
        job = Job(
            id=new_id("job"),
            project_id=project_id,
            spec={},
            created_at=utcnow(),
            updated_at=utcnow(),
            total_steps=3,
        )
        transitions.record_created(session, job)
        return job.id


def force_status(sessions: sessionmaker[Session], job_id: str, status: JobStatus) -> None:
    """Walk the job to `status` through legal transitions only."""
    paths: dict[JobStatus, list[str]] = {
        JobStatus.QUEUED: [],
        JobStatus.RUNNING: ["claim"],
        JobStatus.CANCELLING: ["claim", JobStatus.CANCELLING],
        JobStatus.SUCCEEDED: ["claim", JobStatus.SUCCEEDED],
        JobStatus.FAILED: ["claim", JobStatus.FAILED],
        JobStatus.CANCELLED: [JobStatus.CANCELLED],
        JobStatus.PAUSING: ["claim", JobStatus.PAUSING],
        JobStatus.PAUSED: [JobStatus.PAUSED],
    }
    for step in paths[status]:
        with session_scope(sessions) as session:
            if step == "claim":
                assert transitions.claim(session, job_id, "w") is not None
            else:
                transitions.transition(session, job_id, JobStatus(step))


# What each state means (design.md section 4 and docs/design-notes.md), written out here rather
# than read from `app.jobs.transitions.ALLOWED`, so that a wrong entry in the table fails this test:
# - queued: waiting for a worker. A worker starts it, or it is cancelled before it starts. It
#   cannot end any other way (nothing ran, so it cannot succeed; `queued -> failed` is left out
#   on purpose), and only a running job can be asked to stop (cancelling).
# - running: a worker holds the lease. It ends (succeeded, failed, or cancelled when it stops on a
#   cancel), is asked to stop (cancelling), or goes back to the queue when its lease is released
#   (the reaper after a lost heartbeat, or a graceful hand-over on SIGTERM).
# - cancelling: a stop was asked. It ends cancelled, or failed/succeeded when it ended before it
#   saw the request. It is never re-queued (the reaper cancels a lost cancelling job: running
#   it again would undo the cancel), and it cannot go back to running.
# - pausing: a pause was asked of a running job. It ends paused once its worker checkpointed
#   and stopped, or succeeded/failed when it ended first; a cancel overrides it (cancelling); a
#   resume before the worker stopped takes it back (running). It is not re-queued: the reaper
#   pauses a lost pausing job, which is what its owner asked for.
# - paused: parked with its checkpoints, no worker. A resume queues it, or it is cancelled. A
#   queued job can be paused at once (nothing runs); a paused one never runs without a resume.
# - succeeded, cancelled: final, nothing leaves them.
# - failed: ended (its stream ends, its slot is free), but its checkpoints are kept: a resume
#   queues it again, to continue from the last one (the advice of the guard that failed it, a
#   worker lost once too often). It never runs, ends or pauses without that resume.
# No state moves to itself: a no-op "transition" would write a misleading event.
Q, R, C = JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.CANCELLING
S, F, X = JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED
PG, PD = JobStatus.PAUSING, JobStatus.PAUSED
EXPECTED: dict[JobStatus, set[JobStatus]] = {
    Q: {R, X, PD},
    R: {S, F, X, C, Q, PG, PD},  # running -> paused: the trainer paused itself (a guard)
    C: {X, F, S},
    PG: {PD, C, S, F, R},
    PD: {Q, X},
    S: set(),
    F: {Q},
    X: set(),
}
ENDED = {S, F, X}
# The column stamped when a job enters a state.
STAMPS = {S: "finished_at", F: "finished_at", X: "finished_at", C: "cancel_requested_at"}


def _status_events(session: Session, job_id: str) -> list[JobEvent]:
    return list(
        session.query(JobEvent).filter_by(job_id=job_id, type="status").order_by(JobEvent.id)
    )


def _try(
    sessions: sessionmaker[Session], settings: Settings, source: JobStatus, target: JobStatus
) -> str:
    """Drive a fresh job in `source` to `target`; describe what happened ("moved"/"refused"),
    after checking that the job row and its events agree with that outcome."""
    job_id = new_job(sessions, settings)
    force_status(sessions, job_id, source)
    with session_scope(sessions) as session:
        before = session.query(JobEvent).filter_by(job_id=job_id).count()
    try:
        with session_scope(sessions) as session:
            left = transitions.transition(session, job_id, target)
    except IllegalTransition:
        with session_scope(sessions) as session:
            job = session.get(Job, job_id)
            assert job is not None and job.status == source, (source, target)
            after = session.query(JobEvent).filter_by(job_id=job_id).count()
            assert after == before, f"{source} -> {target} was refused but wrote an event"
        return "refused"
    assert left == source
    with session_scope(sessions) as session:
        job = session.get(Job, job_id)
        assert job is not None and job.status == target, (source, target)
        assert session.query(JobEvent).filter_by(job_id=job_id).count() == before + 1
        last = _status_events(session, job_id)[-1]
        assert last.data is not None
        assert (last.data["from"], last.data["to"]) == (source.value, target.value)
        if target in STAMPS:
            assert getattr(job, STAMPS[target]) is not None, (source, target, STAMPS[target])
    return "moved"


@pytest.mark.parametrize("source", list(JobStatus), ids=str)
def test_each_state_moves_exactly_where_its_meaning_allows(
    sessions: sessionmaker[Session], settings: Settings, source: JobStatus
) -> None:
    outcomes = {target.value: _try(sessions, settings, source, target) for target in JobStatus}
    expected = {
        target.value: "moved" if target in EXPECTED[source] else "refused" for target in JobStatus
    }
    assert outcomes == expected
    # The predicate other code asks agrees with what transition() does.
    assert {t for t in JobStatus if transitions.is_allowed(source, t)} == EXPECTED[source]


def test_the_terminal_set_is_the_set_of_ended_states() -> None:
    """The live stream ends on TERMINAL: the states a job ends in, which only a resume of a
    failed job leaves (to queued)."""
    assert set(transitions.TERMINAL) == ENDED
    assert {s for s, out in EXPECTED.items() if not out} == ENDED - {F}
    assert EXPECTED[F] == {Q}


def test_claim_takes_the_lease_once(sessions: sessionmaker[Session], settings: Settings) -> None:
    job_id = new_job(sessions, settings)
    with session_scope(sessions) as session:
        assert transitions.claim(session, job_id, "worker-a") == 1
    with session_scope(sessions) as session:
        assert transitions.claim(session, job_id, "worker-b") is None
        job = session.get(Job, job_id)
        assert job is not None
        assert (job.status, job.attempt, job.lease_owner) == ("running", 1, "worker-a")


def test_stale_attempt_cannot_change_the_job(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    job_id = new_job(sessions, settings)
    with session_scope(sessions) as session:
        transitions.claim(session, job_id, "a")
    with session_scope(sessions) as session:  # the reaper hands it on
        transitions.transition(session, job_id, JobStatus.QUEUED, attempt=1)
    with session_scope(sessions) as session:
        assert transitions.claim(session, job_id, "b") == 2
    with pytest.raises(IllegalTransition), session_scope(sessions) as session:
        transitions.transition(session, job_id, JobStatus.SUCCEEDED, attempt=1)
    with session_scope(sessions) as session:
        transitions.transition(session, job_id, JobStatus.SUCCEEDED, attempt=2)
        job = session.get(Job, job_id)
        assert job is not None and job.status == "succeeded" and job.finished_at is not None


def test_claim_refuses_a_job_out_of_attempts(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    job_id = new_job(sessions, settings)
    for attempt in range(1, 4):
        with session_scope(sessions) as session:
            assert transitions.claim(session, job_id, "w") == attempt
        with session_scope(sessions) as session:
            transitions.transition(session, job_id, JobStatus.QUEUED, attempt=attempt)
    with session_scope(sessions) as session:
        assert transitions.claim(session, job_id, "w") is None


def test_racing_finishers_yield_exactly_one_terminal_state(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    for _ in range(5):
        job_id = new_job(sessions, settings)
        with session_scope(sessions) as session:
            transitions.claim(session, job_id, "w")
        targets = [JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.QUEUED] * 3
        wins: list[JobStatus] = []
        errors: list[BaseException] = []  # unexpected ones, re-raised here in the main thread
        barrier = threading.Barrier(len(targets))

        def race(
            target: JobStatus,
            barrier: threading.Barrier = barrier,
            job_id: str = job_id,
            wins: list[JobStatus] = wins,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                barrier.wait(timeout=30)
                with session_scope(sessions) as session:
                    transitions.transition(session, job_id, target, attempt=1)
                wins.append(target)
            except IllegalTransition:
                pass  # lost the compare-and-set
            except OperationalError as exc:
                # SQLite may report a lock; that is a loss, not a win. Anything else is a bug.
                if "locked" not in str(exc):
                    errors.append(exc)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=race, args=(t,)) for t in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a racing thread hung"
        assert not errors, errors
        assert len(wins) == 1, wins
        with session_scope(sessions) as session:
            job = session.get(Job, job_id)
            assert job is not None and job.status == wins[0]
            changes = session.query(JobEvent).filter_by(job_id=job_id, type="status").count()
            assert changes == 2  # the claim and the single winner


def test_the_lease_holding_states_are_the_ones_a_worker_reaches_without_giving_the_job_back() -> (
    None
):
    """LEASE_HOLDING_STATES (which repositories filter on and the state machine fences on) must
    be exactly the states the transition table lets a claimed job reach from running without
    going back to the queue, pausing or ending, and from each of them a worker can still finish
    the job (succeeded or failed). Derived from ALLOWED, so a state added to either side alone
    fails here."""
    ends = {JobStatus.QUEUED, JobStatus.PAUSED, *transitions.TERMINAL}
    reached, todo = {JobStatus.RUNNING}, [JobStatus.RUNNING]
    while todo:
        for target in transitions.ALLOWED[todo.pop()]:
            if target not in ends and target not in reached:
                reached.add(target)
                todo.append(target)
    assert set(transitions.LEASE_HOLDING_STATES) == reached
    for state in reached:
        assert {JobStatus.SUCCEEDED, JobStatus.FAILED} <= transitions.ALLOWED[state], state
