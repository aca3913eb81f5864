"""/v1/files: upload a dataset (JSONL, CSV or Parquet) once, reference it from many jobs by id."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, UploadFile

from app.deps import FileDep, PrincipalDep, SessionDep
from app.models import File as FileRow
from app.routes.common import ERRORS
from app.schemas import FileOut
from app.services import files as files_service

router = APIRouter(prefix="/v1/files", tags=["files"], responses=ERRORS)


def _out(row: FileRow) -> FileOut:
    return FileOut.model_validate(row, from_attributes=True)


@router.post(
    "", status_code=201, response_model=FileOut, summary="Upload a dataset (JSONL, CSV or Parquet)"
)
def upload_file(
    principal: PrincipalDep,
    session: SessionDep,
    file: Annotated[UploadFile, File(description="JSONL, CSV (.csv) or Parquet (.parquet) rows.")],
    purpose: Annotated[Literal["train"], Form()] = "train",
) -> FileOut:
    row = files_service.create_file(
        session,
        project_id=principal.project_id,
        filename=file.filename or "upload.jsonl",
        purpose=purpose,
        content=file.file.read(),
    )
    return _out(row)


@router.get("/{file_id}", response_model=FileOut, summary="Get a file's metadata")
def get_file(file: FileDep) -> FileOut:
    return _out(file)
