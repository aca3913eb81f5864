"""Projects and API keys: creation (shown once), authentication, first-start bootstrap."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from app.clock import utcnow
from app.errors import Unauthorized
from app.ids import new_id
from app.models import ApiKey, Project
from app.repositories import keys as keys_repo
from app.security import generate_key, secret_matches, split_key

DEFAULT_PROJECT = "default"


@dataclass(frozen=True)
class CreatedKey:
    project_id: str
    project_name: str
    key_id: str
    plaintext: str


@dataclass(frozen=True)
class Principal:
    project_id: str
    key_id: str


def ensure_project(session: Session, name: str) -> Project:
    project = keys_repo.find_project_by_name(session, name)
    if project is None:
        project = Project(id=new_id("proj"), name=name, created_at=utcnow())
        session.add(project)
        session.flush()
    return project


def create_key(session: Session, project_name: str, key_name: str | None = None) -> CreatedKey:
    project = ensure_project(session, project_name)
    generated = generate_key()
    key = ApiKey(
        id=new_id("key"),
        project_id=project.id,
        prefix=generated.prefix,
        secret_hash=generated.secret_hash,
        name=key_name,
        created_at=utcnow(),
    )
    session.add(key)
    session.flush()
    return CreatedKey(project.id, project.name, key.id, generated.plaintext)


def authenticate(session: Session, authorization: str | None) -> Principal:
    """Resolve `Authorization: Bearer <key>` to its project. One error for every failure so a
    caller learns nothing about which part was wrong."""
    failure = Unauthorized("missing or invalid API key; send Authorization: Bearer <key>")
    if not authorization or not authorization.lower().startswith("bearer "):
        raise failure
    parts = split_key(authorization[7:].strip())
    if parts is None:
        raise failure
    key = keys_repo.find_key_by_prefix(session, parts[0])
    if key is None or key.revoked_at is not None or not secret_matches(parts[1], key.secret_hash):
        raise failure
    return Principal(project_id=key.project_id, key_id=key.id)


def bootstrap_local_key(session: Session) -> CreatedKey | None:
    """On the first start of an empty database, create the default project and one key."""
    if keys_repo.count_keys(session) > 0:
        return None
    return create_key(session, DEFAULT_PROJECT, "local")
