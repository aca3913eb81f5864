"""/v1/usage: what the caller's project stores (checkpoint bytes, in total and per job), its
checkpoint storage quota (app.usage.service), and its quota of active jobs and their devices
(app.jobs.quota)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app.core.deps import SessionDep, StateDep
from app.core.responses import ERRORS
from app.jobs import checkpoints_repository as checkpoints_repo
from app.jobs import quota as active_quota
from app.sessions.deps import PrincipalDep
from app.usage import service as checkpoint_quota
from app.usage.schemas import CheckpointQuotaOut, JobQuotaOut, JobUsage, UsageOut

router = APIRouter(prefix="/v1/usage", tags=["usage"], responses=ERRORS)


@router.get(
    "",
    response_model=UsageOut,
    summary="Storage and quotas of this project",
    description="Checkpoint bytes of the project's jobs (deleted jobs and checkpoints deleted "
    "by retention not counted), from the sizes recorded as each checkpoint was saved; and its "
    "checkpoint storage quota (GRPO_MAX_CHECKPOINT_BYTES_PER_PROJECT), which counts deleted "
    "jobs' checkpoints too until they are purged; and its queued and running jobs and the "
    "devices they ask for, against GRPO_MAX_ACTIVE_JOBS_PER_PROJECT and "
    "GRPO_MAX_ACTIVE_DEVICES_PER_PROJECT.",
)
def get_usage(
    principal: PrincipalDep,
    session: SessionDep,
    state: StateDep,
    limit: Annotated[int, Query(ge=1, le=100, description="Jobs listed, largest first.")] = 20,
) -> UsageOut:
    total, count, jobs = checkpoints_repo.usage_totals(session, project_id=principal.project_id)
    rows = checkpoints_repo.usage_by_job(session, project_id=principal.project_id, limit=limit)
    quota = checkpoint_quota.use_of(
        session,
        project_id=principal.project_id,
        limit=state.settings.max_checkpoint_bytes_per_project,
    )
    active = active_quota.use_of(
        session,
        project_id=principal.project_id,
        limits=active_quota.ActiveLimits.of(state.settings),
    )
    return UsageOut(
        checkpoint_bytes=total,
        checkpoints=count,
        jobs_with_checkpoints=jobs,
        jobs=[
            JobUsage(job_id=r[0], checkpoint_bytes=int(r[1]), checkpoints=int(r[2])) for r in rows
        ],
        has_more=jobs > len(rows),
        checkpoint_quota=CheckpointQuotaOut(
            used_bytes=quota.used_bytes,
            pending_purge_bytes=quota.pending_purge_bytes,
            limit_bytes=quota.limit_bytes,
        ),
        job_quota=JobQuotaOut(
            active_jobs=active.jobs,
            limit_jobs=active.limits.jobs,
            active_devices=active.devices,
            limit_devices=active.limits.devices,
        ),
    )
