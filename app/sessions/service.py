"""Projects and API keys: creation (shown once), authentication, first-start bootstrap."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from app.core import db
from app.core.clock import as_utc, utcnow
from app.core.errors import NotFound, Unauthorized
from app.core.ids import new_id
from app.core.models import ApiKey, Project
from app.core.security import VerifiedKeys, generate_key, secret_matches, split_key
from app.sessions import repository as keys_repo
from app.sessions.revocations import RevocationEpoch

DEFAULT_PROJECT = "default"
# How long a verified key is trusted without a database lookup, while no key is revoked
# (app.sessions.revocations: a revocation through the API or the CLI holds at once); a key
# revoked in the database by other means may keep working this long in each API process.
KEY_CACHE_TTL_S = 5.0
KEY_CACHE_MAX_ENTRIES = 10_000


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


def ensure_project(session: Session, *, name: str) -> Project:
    """The project called `name`, created if it does not exist yet."""
    project = keys_repo.find_project_by_name(session, name=name)
    if project is None:
        project = keys_repo.add_project(
            session, project=Project(id=new_id("proj"), name=name, created_at=utcnow())
        )
    return project


# Positional parameters kept: the CLI and the test fixtures call it as create_key(session, name).
def create_key(session: Session, project_name: str, key_name: str | None = None) -> CreatedKey:
    """A new key for the project (created if needed); the plaintext exists only in the result."""
    project = ensure_project(session, name=project_name)
    generated = generate_key()
    key = ApiKey(
        id=new_id("key"),
        project_id=project.id,
        prefix=generated.prefix,
        secret_hash=generated.secret_hash,
        name=key_name,
        created_at=utcnow(),
    )
    keys_repo.add_key(session, key=key)
    return CreatedKey(project.id, project.name, key.id, generated.plaintext)


# Per process: every API process verifies a key once per KEY_CACHE_TTL_S at most.
_verified: VerifiedKeys[Principal] = VerifiedKeys(KEY_CACHE_TTL_S, KEY_CACHE_MAX_ENTRIES)


def authenticate(
    session: Session, *, authorization: str | None, revocations: RevocationEpoch
) -> Principal:
    """Resolve `Authorization: Bearer <key>` to its project. One error for every failure so a
    caller learns nothing about which part was wrong. A cached verification counts only under
    the revocation counter it was made under (read before the lookup: app.sessions.revocations)."""
    failure = Unauthorized("missing or invalid API key; send Authorization: Bearer <key>")
    if not authorization or not authorization.lower().startswith("bearer "):
        raise failure
    presented = authorization[7:].strip()
    epoch = revocations.read()
    cached = _verified.get(presented, epoch) if epoch is not None else None
    if cached is not None:
        return cached
    parts = split_key(presented)
    if parts is None:
        raise failure
    key = keys_repo.find_key_by_prefix(session, prefix=parts[0])
    if key is None or key.revoked_at is not None or not secret_matches(parts[1], key.secret_hash):
        raise failure
    principal = Principal(project_id=key.project_id, key_id=key.id)
    if epoch is not None:
        _verified.put(presented, principal, epoch)
    return principal


@dataclass(frozen=True)
class SessionKey:
    """A key that session tokens name: its principal, and its last sign-out (unix
    milliseconds; None when it was never signed out), before which its tokens are refused."""

    principal: Principal
    signed_out_at_ms: int | None


# Keys that signed-in sessions named, verified in the last KEY_CACHE_TTL_S (by key id; the
# token's signature and expiry are checked on every request before this is consulted).
_session_keys: VerifiedKeys[SessionKey] = VerifiedKeys(KEY_CACHE_TTL_S, KEY_CACHE_MAX_ENTRIES)


def _unix_ms(value: datetime | None) -> int | None:
    moment = as_utc(value)
    return None if moment is None else int(moment.timestamp() * 1000)


def authenticate_session(
    session: Session, *, key_id: str, issued_at_ms: int, revocations: RevocationEpoch
) -> Principal:
    """The project of the key a verified session token names, while that key exists and is not
    revoked, and the token was issued after the key's last sign-out: a session is a second way
    to the same Principal as `authenticate`, and ends with its key or a sign-out, at once in
    every API process (the revocation counter, as for a Bearer key)."""
    epoch = revocations.read()
    cached = _session_keys.get(key_id, epoch) if epoch is not None else None
    if cached is None:
        key = keys_repo.find_key_by_id(session, key_id=key_id)
        if key is None or key.revoked_at is not None:
            raise Unauthorized("the session has ended (its key was revoked); sign in again")
        principal = Principal(project_id=key.project_id, key_id=key.id)
        cached = SessionKey(principal, _unix_ms(key.sessions_valid_after))
        if epoch is not None:
            _session_keys.put(key_id, cached, epoch)
    signed_out = cached.signed_out_at_ms
    if signed_out is not None and issued_at_ms <= signed_out:
        raise Unauthorized("the session was signed out; sign in again")
    return cached.principal


def end_sessions(session: Session, *, key_id: str, revocations: RevocationEpoch) -> None:
    """Sign out every session of the key issued until now, in every browser that holds one (a
    session is a key's, not a person's). Every API process refuses them at once (the
    revocation counter; without Redis no process caches a verified key)."""
    keys_repo.end_sessions(session, key_id=key_id, until=utcnow())
    db.after_commit(session, lambda _session: _stale_everywhere(revocations))


def _stale_everywhere(revocations: RevocationEpoch) -> None:
    """Once a revocation or sign-out is committed: no cached verification is trusted again, in
    this process (even an entry cached meanwhile) or, through the counter, in any other."""
    _verified.clear()
    _session_keys.clear()
    revocations.bump()


def revoke_key(session: Session, *, key: ApiKey, revocations: RevocationEpoch) -> ApiKey:
    """Revoke `key` (idempotent: a revoked key keeps its first revocation time). From the
    commit on, it and its dashboard sessions get 401 in every API process."""
    if key.revoked_at is None:
        keys_repo.revoke(session, key_id=key.id, at=utcnow())
        keys_repo.reload_key(session, key=key)
    db.after_commit(session, lambda _session: _stale_everywhere(revocations))
    return key


def project_key(session: Session, *, project_id: str, key_id: str) -> ApiKey:
    """The project's key `key_id`; NotFound (404 naming `key_id`) for any other, another
    project's included, so an id never tells whether it exists elsewhere."""
    key = keys_repo.find_key_of_project(session, project_id=project_id, key_id=key_id)
    if key is None:
        raise NotFound(f"key {key_id} not found", param="key_id")
    return key


def project_keys(session: Session, *, project_id: str) -> list[ApiKey]:
    """The project's keys, revoked ones included, newest first."""
    return keys_repo.list_keys(session, project_id=project_id)


def project_name(session: Session, *, project_id: str) -> str:
    project = keys_repo.get_project(session, project_id=project_id)
    return project.name if project is not None else project_id


def bootstrap_local_key(session: Session) -> CreatedKey | None:
    """On the first start of an empty database, create the default project and one key."""
    if keys_repo.count_keys(session) > 0:
        return None
    return create_key(session, DEFAULT_PROJECT, "local")
