"""Uploaded dataset files."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import File


def add(session: Session, *, file: File) -> File:
    session.add(file)
    session.flush()
    return file


def get(session: Session, *, file_id: str) -> File | None:
    """Any project's file: for the worker, which resolves the file a stored spec names."""
    return session.get(File, file_id)


def get_for_project(session: Session, *, project_id: str, file_id: str) -> File | None:
    return session.scalars(
        select(File).where(File.id == file_id, File.project_id == project_id)
    ).one_or_none()
