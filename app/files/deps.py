"""The loader of the file named in the path: the caller's upload or result file, or 404."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path

from app.core.deps import SessionDep
from app.core.models import File
from app.files import service as files_service
from app.sessions.deps import PrincipalDep

FileId = Annotated[str, Path(max_length=64, description="File id.")]


def get_file(file_id: FileId, principal: PrincipalDep, session: SessionDep) -> File:
    """The caller's file named in the path, or 404 (param `file_id`)."""
    return files_service.get_file(session, project_id=principal.project_id, file_id=file_id)


FileDep = Annotated[File, Depends(get_file)]
