"""The loader of the job named in the path (the caller's, or 404), and the process's idempotent
create (app.jobs.service.JobCreation), handed to the create routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from app.core.deps import SessionDep
from app.core.models import Job
from app.jobs import service as jobs_service
from app.sessions.deps import PrincipalDep

JobId = Annotated[str, Path(max_length=64, description="Job id.")]


async def get_job_creation(request: Request) -> jobs_service.JobCreation:
    """The process's idempotent create (app.jobs.service.JobCreation), built at start-up by
    app.main.create_app."""
    creation: jobs_service.JobCreation = request.app.state.job_creation
    return creation


JobCreationDep = Annotated[jobs_service.JobCreation, Depends(get_job_creation)]


def get_job(job_id: JobId, principal: PrincipalDep, session: SessionDep) -> Job:
    """The caller's job named in the path, or 404 (param `job_id`)."""
    return jobs_service.get_job(session, project_id=principal.project_id, job_id=job_id)


JobDep = Annotated[Job, Depends(get_job)]
