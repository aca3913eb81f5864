"""The bytes Tinker calls hold in the shared database, and their bound.

A call's body (up to ``GRPO_TINKER_MAX_BODY_BYTES`` of protobuf) is stored until its worker
applies or refuses it, then dropped (app.tinker.worker_repository.settle,
app.tinker.repository.fail_queued); its result is stored until the client has read it (then
kept ``RESULT_GRACE_S`` more, for a poll whose answer was lost on the way) or, unread, for
``GRPO_TINKER_RESULT_RETENTION_S``. The call rows of a session that ended that long ago are
deleted. Each row carries ``stored_bytes``: what it still holds. A project's sum is bounded
by ``GRPO_TINKER_MAX_STORED_BYTES_PER_PROJECT``; a call past it is a 429 that names the limit,
before anything of it is stored. The sweeps run in the workers' maintenance
(worker.tinker_upkeep); their queries are app.tinker.upkeep_repository's.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.core.errors import TooManyRequests
from app.core.settings import Settings
from app.tinker import repository as repo
from app.tinker.upkeep_repository import RESULT_GRACE_S

__all__ = ["RESULT_GRACE_S", "STORAGE_RETRY_S", "check_room"]

# Retry-After of a full store: results are dropped within a grace period of being read.
STORAGE_RETRY_S = 10


def check_room(db: Session, settings: Settings, *, project_id: str, adding: int) -> None:
    """429 when storing ``adding`` more bytes would pass the project's limit (call it under
    the project's lock: the sum and the insert are one step)."""
    limit = settings.tinker_max_stored_bytes_per_project
    held = repo.stored_bytes(db, project_id=project_id)
    if held + adding > limit:
        raise TooManyRequests(
            f"this project's Tinker calls and results hold {held} bytes; {adding} more would "
            f"pass GRPO_TINKER_MAX_STORED_BYTES_PER_PROJECT ({limit}). Retrieve the results of "
            "finished calls (each is dropped once read) or wait for queued calls to be applied",
            retry_after=STORAGE_RETRY_S,
            param="GRPO_TINKER_MAX_STORED_BYTES_PER_PROJECT",
        )
