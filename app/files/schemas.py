"""Response bodies of /v1/files."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class FileOut(BaseModel):
    """OpenAI's file object (openai-python's FileObject), plus the row count."""

    object: Literal["file"] = "file"
    id: str
    bytes: int
    created_at: int = Field(description="Unix seconds.")
    filename: str
    purpose: str = Field(
        description="`train` or `fine-tune` (uploads), `fine-tune-results` (a job's metrics)."
    )
    status: Literal["processed"] = Field(
        default="processed", description="Every row is validated at upload: always processed."
    )
    expires_at: int | None = None
    status_details: str | None = None
    row_count: int = Field(description="Rows of an upload; steps of a result file.")


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileOut]
    has_more: bool
    first_id: str | None
    last_id: str | None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: Literal[True] = True
