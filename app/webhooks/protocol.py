"""The webhook protocol (Standard Webhooks, https://www.standardwebhooks.com): event types,
payload shape, signing secrets and signatures. Declared once; the API (endpoints, the outbox
written by app.jobs.transitions) and the worker (worker.webhooks, which sends) both use it."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from datetime import datetime
from typing import Any, Literal, get_args

EventType = Literal["job.running", "job.succeeded", "job.failed", "job.cancelled", "job.checkpoint"]
EVENT_TYPES: tuple[str, ...] = get_args(EventType)

# The status a job enters -> the event it emits (app.jobs.transitions). job.checkpoint comes from
# the worker's checkpoint record (worker.progress).
STATUS_EVENTS = {
    "running": "job.running",
    "succeeded": "job.succeeded",
    "failed": "job.failed",
    "cancelled": "job.cancelled",
}
CHECKPOINT_EVENT = "job.checkpoint"

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32
# Error messages in payloads are cut here: a payload is stored once per endpoint.
MAX_ERROR_CHARS = 1000


def new_secret() -> str:
    """A signing secret: `whsec_` + base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def secret_key(secret: str) -> bytes:
    """The HMAC key a `whsec_...` secret stands for (the base64-decoded part after the prefix)."""
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))


def sign(secret: str, *, msg_id: str, timestamp: int, body: str) -> str:
    """The `webhook-signature` header: `v1,` + base64 HMAC-SHA256 of `{id}.{timestamp}.{body}`."""
    to_sign = f"{msg_id}.{timestamp}.{body}".encode()
    digest = hmac.new(secret_key(secret), to_sign, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def encode(payload: dict[str, Any]) -> str:
    """The request body, exactly the text that is signed."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


def job_payload(
    event_type: str,
    *,
    at: datetime,
    job: dict[str, Any],
    previous_status: str | None = None,
    step: int | None = None,
) -> dict[str, Any]:
    """`{"type", "timestamp", "data": {...}}` for an event of the job whose columns are `job`
    (id, name, status, attempt, current_step, total_steps, error_code, error_message)."""
    error = None
    if job.get("error_code"):
        message = job.get("error_message")
        error = {
            "code": job["error_code"],
            "message": message[:MAX_ERROR_CHARS] if isinstance(message, str) else None,
        }
    return {
        "type": event_type,
        "timestamp": at.isoformat().replace("+00:00", "Z"),
        "data": {
            "object": "job",
            "job_id": job["id"],
            "name": job.get("name"),
            "status": job["status"],
            "previous_status": previous_status,
            "step": job.get("current_step", 0) if step is None else step,
            "total_steps": job.get("total_steps", 0),
            "attempt": job.get("attempt", 0),
            "error": error,
        },
    }
