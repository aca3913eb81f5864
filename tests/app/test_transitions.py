"""The job state machine: allowed and illegal transitions, fencing, races."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy.orm import Session, sessionmaker

from app import transitions
from app.clock import utcnow
from app.db import make_engine, make_session_factory, session_scope
from app.errors import IllegalTransition
from app.ids import new_id
from app.models import Job, JobEvent
from app.settings import Settings
from app.transitions import ALLOWED, JobStatus
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
    paths = {
        JobStatus.QUEUED: [],
        JobStatus.RUNNING: ["claim"],
        JobStatus.CANCELLING: ["claim", JobStatus.CANCELLING],
        JobStatus.SUCCEEDED: ["claim", JobStatus.SUCCEEDED],
        JobStatus.FAILED: ["claim", JobStatus.FAILED],
        JobStatus.CANCELLED: [JobStatus.CANCELLED],
    }
    for step in paths[status]:
        with session_scope(sessions) as session:
            if step == "claim":
                assert transitions.claim(session, job_id, "w") is not None
            else:
                transitions.transition(session, job_id, JobStatus(step))


def test_every_illegal_transition_is_refused_and_leaves_no_event(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    for source in JobStatus:
        for target in JobStatus:
            if target in ALLOWED[source]:
                continue
            job_id = new_job(sessions, settings)
            force_status(sessions, job_id, source)
            with session_scope(sessions) as session:
                before = session.query(JobEvent).filter_by(job_id=job_id).count()
            with pytest.raises(IllegalTransition), session_scope(sessions) as session:
                transitions.transition(session, job_id, target)
            with session_scope(sessions) as session:
                job = session.get(Job, job_id)
                assert job is not None and job.status == source
                assert session.query(JobEvent).filter_by(job_id=job_id).count() == before


def test_terminal_states_are_final() -> None:
    for state in transitions.TERMINAL:
        assert ALLOWED[state] == frozenset()


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
        barrier = threading.Barrier(len(targets))

        def race(
            target: JobStatus,
            barrier: threading.Barrier = barrier,
            job_id: str = job_id,
            wins: list[JobStatus] = wins,
        ) -> None:
            barrier.wait()
            try:
                with session_scope(sessions) as session:
                    transitions.transition(session, job_id, target, attempt=1)
                wins.append(target)
            except IllegalTransition:
                pass
            except Exception as exc:  # SQLite may report a lock; that is a loss, not a win
                assert "locked" in str(exc)

        threads = [threading.Thread(target=race, args=(t,)) for t in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1, wins
        with session_scope(sessions) as session:
            job = session.get(Job, job_id)
            assert job is not None and job.status == wins[0]
            changes = session.query(JobEvent).filter_by(job_id=job_id, type="status").count()
            assert changes == 2  # the claim and the single winner
