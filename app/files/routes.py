"""/v1/files: upload a dataset (JSONL, CSV or Parquet) once, reference it from many jobs by id.

The objects are OpenAI's (openai-python's FileObject), so `client.files.create(...,
purpose="fine-tune")`, `list`, `retrieve`, `content` and `delete` work unchanged."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import Response

from app.core.clock import as_utc, utcnow
from app.core.deps import SessionDep, StateDep
from app.core.models import File as FileRow
from app.core.responses import CONFLICT, OPENAI_ERRORS, ErrorResponse
from app.files import service as files_service
from app.files.deps import FileDep
from app.files.schemas import FileDeleted, FileList, FileOut
from app.sessions.deps import PrincipalDep

router = APIRouter(prefix="/v1/files", tags=["files"], responses=OPENAI_ERRORS)


def file_out(row: FileRow) -> FileOut:
    created = as_utc(row.created_at) or utcnow()
    return FileOut(
        id=row.id,
        bytes=row.bytes,
        created_at=int(created.timestamp()),
        filename=row.filename,
        purpose=row.purpose,
        row_count=row.row_count,
    )


@router.post(
    "",
    status_code=201,
    response_model=FileOut,
    summary="Upload a dataset (JSONL, CSV or Parquet)",
    responses={
        413: {
            "model": ErrorResponse,
            "description": "The body is over GRPO_MAX_BODY_BYTES, or its rows decode past the "
            "dataset memory budget (a row, or the rows together).",
        },
        429: {
            "model": ErrorResponse,
            "description": "The project's uploads hold its share of this server's decoding "
            "slots (GRPO_MAX_CONCURRENT_UPLOADS_PER_PROJECT); see Retry-After.",
        },
        503: {
            "model": ErrorResponse,
            "description": "Database unavailable, or every decoding slot of this server is busy "
            "(GRPO_MAX_CONCURRENT_UPLOADS); see Retry-After.",
        },
    },
)
def upload_file(
    principal: PrincipalDep,
    session: SessionDep,
    state: StateDep,
    file: Annotated[UploadFile, File(description="JSONL, CSV (.csv) or Parquet (.parquet) rows.")],
    purpose: Annotated[
        Literal["train", "fine-tune"],
        Form(description="`fine-tune` (OpenAI's name) and `train` mean the same."),
    ] = "train",
) -> FileOut:
    row = files_service.create_file(
        session,
        project_id=principal.project_id,
        filename=file.filename or "upload.jsonl",
        purpose=purpose,
        body=file.file,
        uploads=state.uploads,
    )
    return file_out(row)


@router.get("", response_model=FileList, summary="List the project's uploads")
def list_files(
    principal: PrincipalDep,
    session: SessionDep,
    after: Annotated[str | None, Query(max_length=64, description="Cursor: last id seen.")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Annotated[Literal["asc", "desc"], Query(description="By creation time.")] = "desc",
    purpose: Annotated[str | None, Query(max_length=32)] = None,
) -> FileList:
    rows, has_more = files_service.list_files(
        session,
        project_id=principal.project_id,
        after=after,
        limit=limit,
        newest_first=order == "desc",
        purpose=purpose,
    )
    return FileList(
        data=[file_out(r) for r in rows],
        has_more=has_more,
        first_id=rows[0].id if rows else None,
        last_id=rows[-1].id if rows else None,
    )


@router.get("/{file_id}", response_model=FileOut, summary="Get a file's metadata")
def get_file(file: FileDep) -> FileOut:
    return file_out(file)


@router.get(
    "/{file_id}/content",
    summary="A file's content: an upload's rows as JSONL, a result file's metrics as CSV",
    response_class=Response,
)
def file_content(file: FileDep, session: SessionDep) -> Response:
    # Read whole inside the request's unit of work (a streamed body would outlive the
    # session); bounded: uploads by the body limit, result files by the step limit.
    body = b"".join(files_service.content_chunks(session, file=file))
    return Response(
        body,
        media_type=files_service.media_type(file),
        headers={"Content-Disposition": f'attachment; filename="{file.id}"'},
    )


@router.delete(
    "/{file_id}",
    response_model=FileDeleted,
    summary="Delete an upload (409 while a job that has not ended uses it)",
    responses={409: CONFLICT},
)
def delete_file(file: FileDep, session: SessionDep) -> FileDeleted:
    files_service.delete_file(session, file=file)
    return FileDeleted(id=file.id)
