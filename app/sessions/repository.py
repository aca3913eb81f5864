"""Projects and API keys."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.core.models import ApiKey, Project


def add_project(session: Session, *, project: Project) -> Project:
    session.add(project)
    session.flush()
    return project


def add_key(session: Session, *, key: ApiKey) -> ApiKey:
    session.add(key)
    session.flush()
    return key


def find_key_by_prefix(session: Session, *, prefix: str) -> ApiKey | None:
    return session.scalars(select(ApiKey).where(ApiKey.prefix == prefix)).one_or_none()


def find_key_by_id(session: Session, *, key_id: str) -> ApiKey | None:
    return session.get(ApiKey, key_id)


def find_key_of_project(session: Session, *, project_id: str, key_id: str) -> ApiKey | None:
    return session.scalars(
        select(ApiKey).where(ApiKey.id == key_id, ApiKey.project_id == project_id)
    ).one_or_none()


def list_keys(session: Session, *, project_id: str | None = None) -> list[ApiKey]:
    """Keys newest first (ids are time-ordered): the project's, or every project's."""
    query = select(ApiKey)
    if project_id is not None:
        query = query.where(ApiKey.project_id == project_id)
    return list(session.scalars(query.order_by(ApiKey.id.desc())))


def reload_key(session: Session, *, key: ApiKey) -> ApiKey:
    """Re-read a loaded key; bulk updates (`revoke`) bypass the identity map."""
    session.refresh(key)
    return key


def revoke(session: Session, *, key_id: str, at: datetime) -> None:
    """Mark the key revoked at `at`, unless it already is (its first revocation stands)."""
    session.execute(
        update(ApiKey)
        .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=at)
        .execution_options(synchronize_session=False)
    )


def end_sessions(session: Session, *, key_id: str, until: datetime) -> None:
    """Refuse the key's session tokens issued at or before `until` from now on."""
    session.execute(
        update(ApiKey)
        .where(ApiKey.id == key_id)
        .values(sessions_valid_after=until)
        .execution_options(synchronize_session=False)
    )


def get_project(session: Session, *, project_id: str) -> Project | None:
    return session.get(Project, project_id)


def find_project_by_name(session: Session, *, name: str) -> Project | None:
    return session.scalars(select(Project).where(Project.name == name)).one_or_none()


def count_keys(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(ApiKey)) or 0)
