"""Idempotency-Key for job creation: a create with a key claims it in transactions of its own
(visible to a concurrent duplicate before the create's work is done), releases it when the
create's unit of work rolls back, and stores the response it sent, which a retry with the same
key and body gets again byte for byte (:class:`Replay`)."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.core import db
from app.core.clock import as_utc, utcnow
from app.core.errors import Conflict, IdempotencyKeyReused
from app.jobs import idempotency_repository as idem_repo

# An in-progress idempotency claim older than this belongs to a request that died mid-way.
STALE_CLAIM = timedelta(seconds=60)


@dataclass(frozen=True)
class Replay:
    """The stored first response of an idempotent retry, to be sent again unchanged."""

    status_code: int
    body: dict[str, Any]


def spec_fingerprint(raw_body: dict[str, Any]) -> str:
    """Hash of the request body as sent (key order does not matter)."""
    canonical = json.dumps(raw_body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _claim_key(
    claims: sessionmaker[Session], *, project_id: str, key: str, fingerprint: str, ttl: timedelta
) -> Replay | None:
    """Claim the idempotency key in its own committed transactions: the one place outside a
    boundary that commits, on purpose. The claim must be visible to a concurrent duplicate
    *before* this request has done its work (turning the duplicate into a 409, not a second
    job), so it cannot wait for the request's commit. `claims` runs each statement as its own
    transaction (app.core.state); a first request claims with one statement. Returns the
    stored response for a replay, raises for a mismatch or a request still in flight, or None
    when this request owns the key and must do the work."""
    now = utcnow()
    with db.session_scope(claims) as session:
        if idem_repo.claim(
            session,
            project_id=project_id,
            key=key,
            request_hash=fingerprint,
            now=now,
            expired_before=now - ttl,
        ):
            return None
        record = idem_repo.get(session, project_id=project_id, key=key)
    if record is None:  # released between our two statements: try once more
        raise Conflict(
            "idempotency key is being reused concurrently; retry", param="Idempotency-Key"
        )
    if record.request_hash != fingerprint:
        raise IdempotencyKeyReused(
            "this Idempotency-Key was used with a different request body",
            param="Idempotency-Key",
        )
    if record.state != "completed":
        if now - (as_utc(record.created_at) or now) > STALE_CLAIM:
            # Its request died mid-way: release the claim (only while it is still that stale
            # one, never a retry's fresh claim), so the next retry is served.
            _release_key(claims, project_id=project_id, key=key, claimed_before=now - STALE_CLAIM)
            raise Conflict(
                "an earlier request with this Idempotency-Key did not finish; retry",
                param="Idempotency-Key",
            )
        raise Conflict(
            "a request with this Idempotency-Key is still in progress", param="Idempotency-Key"
        )
    return Replay(record.response_status or 201, record.response_body or {})


def _release_key(
    claims: sessionmaker[Session],
    *,
    project_id: str,
    key: str,
    claimed_before: datetime | None = None,
) -> None:
    """Give a claimed key back (its own transaction, like the claim) so a retry can proceed;
    with `claimed_before`, only an in-progress claim made before then."""
    with db.session_scope(claims) as session:
        idem_repo.release(session, project_id=project_id, key=key, claimed_before=claimed_before)


def claim_for_request(
    session: Session,
    claims: sessionmaker[Session],
    *,
    project_id: str,
    key: str,
    fingerprint: str,
    ttl: timedelta,
) -> Replay | None:
    """Claim `key` for the request whose unit of work is `session` (:func:`_claim_key`): the
    stored first response of a retry, or None when this request owns the key. The claim is
    committed at once; if the request's unit of work then rolls back (a bad dataset file, the
    quota, a failed commit) it is released, so a retry is served at once instead of getting
    409s until the claim goes stale."""
    replay = _claim_key(claims, project_id=project_id, key=key, fingerprint=fingerprint, ttl=ttl)
    if replay is None:
        db.after_rollback(
            session, functools.partial(_release_key, claims, project_id=project_id, key=key)
        )
    return replay


def record_response(
    session: Session,
    *,
    project_id: str,
    idempotency_key: str | None,
    status_code: int,
    body: dict[str, Any],
) -> None:
    """Store the response of the request that owns `idempotency_key`, for its retries to
    replay byte for byte. No-op without a key."""
    if idempotency_key is not None:
        idem_repo.complete(
            session, project_id=project_id, key=idempotency_key, status=status_code, body=body
        )
