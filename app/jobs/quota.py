"""A project's quota of active jobs: how many queued and running jobs it may hold
(`GRPO_MAX_ACTIVE_JOBS_PER_PROJECT`) and how many devices those jobs may ask for together
(`GRPO_MAX_ACTIVE_DEVICES_PER_PROJECT`, the sum of their `resources.devices`).

Both count the jobs in app.core.job_status.QUOTA_COUNTED_STATES (queued, running, cancelling,
pausing; not paused, not ended), in one pass over the project's active jobs
(`slots_repo.count_active_and_dispatched`), under the project's row lock: a create (at its
commit) and a resume both check here, and the lock is held until their commit, so two of them
at the limit cannot both pass. A refusal is a 429 `quota_exceeded` naming the setting: nothing
is wrong with the request, it only has to come later. `GET /v1/usage` shows the same figures
(`use_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from app.core import projects_repository as projects_repo
from app.core.errors import QuotaExceeded
from app.core.settings import Settings
from app.jobs import slots_repository as slots_repo

# A project at its limit waits for jobs to end; there is no better estimate of when.
QUOTA_RETRY_AFTER_S = 30


@dataclass(frozen=True)
class ActiveLimits:
    jobs: int  # max_active_jobs_per_project
    devices: int  # max_active_devices_per_project

    @classmethod
    def of(cls, settings: Settings) -> ActiveLimits:
        return cls(settings.max_active_jobs_per_project, settings.max_active_devices_per_project)


@dataclass(frozen=True)
class ActiveUse:
    jobs: int
    devices: int
    limits: ActiveLimits


def use_of(session: Session, *, project_id: str, limits: ActiveLimits) -> ActiveUse:
    """The project's active jobs and their devices, against `limits` (a plain read)."""
    counts = slots_repo.count_active_and_dispatched(session, project_id=project_id)
    return ActiveUse(counts.jobs, counts.devices, limits)


def check_active_jobs(
    session: Session, *, project_id: str, limits: ActiveLimits, queue: str
) -> int:
    """QuotaExceeded (429) when the project holds more than `limits.jobs` queued or running
    jobs, or those jobs more than `limits.devices` devices, counting the one this unit of work
    has just added (or resumed); else how many of its jobs hold a dispatch slot of the size
    class of `queue` (app.jobs.dispatch), counted in the same pass under the same lock.

    Exact under concurrency: the count is taken under the project's row lock and the lock is
    held until the commit, so two creates at the limit cannot both pass (the second counts the
    first's committed job). `create_job` runs this as the last work before the commit
    (app.core.db.before_commit): the lock is then held for one count and the commit, in one
    thread, and not across the rest of the request, which is what serialised one project's
    creates."""
    projects_repo.lock(session, project_id=project_id)
    counts = slots_repo.count_active_and_dispatched(session, project_id=project_id, queue=queue)
    if counts.jobs > limits.jobs:
        raise QuotaExceeded(
            f"this project has {counts.jobs - 1} queued or running jobs, the most it may have "
            f"(max_active_jobs_per_project={limits.jobs}); wait for one to end or cancel one",
            retry_after=QUOTA_RETRY_AFTER_S,
        )
    if counts.devices > limits.devices:
        raise QuotaExceeded(
            f"with this job, this project's queued and running jobs would ask for "
            f"{counts.devices} devices, more than it may (max_active_devices_per_project="
            f"{limits.devices}); wait for one to end or cancel one",
            retry_after=QUOTA_RETRY_AFTER_S,
        )
    return counts.dispatched
