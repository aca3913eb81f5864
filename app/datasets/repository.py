"""Uploaded dataset files."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session, defer

from app.core.models import File


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


def list_page(
    session: Session,
    *,
    project_id: str,
    after: str | None,
    limit: int,
    newest_first: bool,
    purpose: str | None,
) -> tuple[list[File], bool]:
    """A page of the project's files in id (creation) order; `after` is the last id seen.
    The rows column is deferred: a list shows metadata, and rows can be megabytes."""
    query = select(File).where(File.project_id == project_id).options(defer(File.rows))
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    if after is not None:
        query = query.where(File.id < after if newest_first else File.id > after)
    order = File.id.desc() if newest_first else File.id
    rows = list(session.scalars(query.order_by(order).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def delete(session: Session, *, file: File) -> None:
    session.delete(file)
    session.flush()
