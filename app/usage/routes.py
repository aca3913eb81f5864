"""/v1/usage: what the caller's project stores (checkpoint bytes, in total and per job), its
checkpoint storage quota (app.usage.service), its quota of active jobs and their devices
(app.jobs.quota), the tokens its chat and completion requests used, per model and day,
against its daily quota (app.gateway.quota), and its use of the Tinker API (app.tinker):
sessions, training clients and calls over the last days, and those live now against their
quotas."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy.orm import Session

from app.core.clock import utcnow
from app.core.deps import SessionDep, StateDep
from app.core.responses import ERRORS
from app.core.settings import Settings
from app.gateway import quota as inference_quota
from app.gateway import usage_repository as inference_usage
from app.jobs import checkpoints_repository as checkpoints_repo
from app.jobs import quota as active_quota
from app.sessions.deps import PrincipalDep
from app.tinker import repository as tinker_repo
from app.usage import service as checkpoint_quota
from app.usage.schemas import (
    CheckpointQuotaOut,
    InferenceModelUsage,
    InferenceUsageOut,
    JobQuotaOut,
    JobUsage,
    TinkerCallsOut,
    TinkerUsageOut,
    UsageOut,
)

# Rows of inference usage listed at most (models x days).
MAX_INFERENCE_ROWS = 500

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
    "GRPO_MAX_ACTIVE_DEVICES_PER_PROJECT; and the tokens of its chat and completion requests "
    "per model and UTC day, against GRPO_INFERENCE_DAILY_TOKENS_PER_PROJECT; and the Tinker sessions, training clients and calls "
    "of the last `tinker_days` UTC days, and the sessions and training clients live now against "
    "GRPO_TINKER_MAX_SESSIONS_PER_PROJECT and GRPO_TINKER_MAX_MODELS_PER_PROJECT.",
)
def get_usage(
    principal: PrincipalDep,
    session: SessionDep,
    state: StateDep,
    limit: Annotated[int, Query(ge=1, le=100, description="Jobs listed, largest first.")] = 20,
    inference_days: Annotated[
        int, Query(ge=1, le=90, description="Days of inference usage listed, today included.")
    ] = 7,
    tinker_days: Annotated[
        int, Query(ge=1, le=90, description="Days of Tinker activity counted, today included.")
    ] = 7,
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
        inference=_inference(
            session, project_id=principal.project_id, settings=state.settings, days=inference_days
        ),
        tinker=_tinker(
            session, project_id=principal.project_id, settings=state.settings, days=tinker_days
        ),
    )


def _inference(
    session: Session, *, project_id: str, settings: Settings, days: int
) -> InferenceUsageOut:
    now = utcnow()
    today = inference_quota.use_of(
        session,
        project_id=project_id,
        limit=settings.inference_daily_tokens_per_project,
        now=now,
    )
    rows, more = inference_usage.rows_since(
        session,
        project_id=project_id,
        since_day=inference_usage.day_of(now - timedelta(days=days - 1)),
        limit=MAX_INFERENCE_ROWS,
    )
    return InferenceUsageOut(
        day=today.day,
        tokens_today=today.tokens,
        daily_token_limit=today.limit,
        max_concurrent_requests=settings.inference_max_concurrent_per_project,
        data=[
            InferenceModelUsage(
                model=r.model,
                day=r.day,
                requests=r.requests,
                prompt_tokens=r.prompt_tokens,
                completion_tokens=r.completion_tokens,
                total_tokens=r.prompt_tokens + r.completion_tokens,
            )
            for r in rows
        ],
        has_more=more,
    )


def _tinker(session: Session, *, project_id: str, settings: Settings, days: int) -> TinkerUsageOut:
    now = utcnow()
    first_day = (now - timedelta(days=days - 1)).date()
    since = datetime.combine(first_day, time.min, tzinfo=UTC)
    sessions, models = tinker_repo.created_since(session, project_id=project_id, since=since)
    calls: dict[str, dict[str, int]] = {}
    for kind, status, n in tinker_repo.calls_since(session, project_id=project_id, since=since):
        calls.setdefault(kind, {})[status] = n
    stale = tinker_repo.stale_since(now, settings.tinker_session_ttl_s)
    return TinkerUsageOut(
        days=days,
        since=inference_usage.day_of(first_day),
        sessions_created=sessions,
        models_created=models,
        calls=[
            TinkerCallsOut(
                kind=kind,
                requests=sum(by_status.values()),
                applied=by_status.get("done", 0),
                failed=by_status.get("failed", 0),
                queued=by_status.get("queued", 0),
            )
            for kind, by_status in sorted(calls.items())
        ],
        live_sessions=tinker_repo.live_sessions(session, project_id=project_id, since=stale),
        limit_sessions=settings.tinker_max_sessions_per_project,
        live_models=tinker_repo.live_models(session, project_id=project_id),
        limit_models=settings.tinker_max_models_per_project,
        stored_bytes=tinker_repo.stored_bytes(session, project_id=project_id),
        limit_stored_bytes=settings.tinker_max_stored_bytes_per_project,
    )
