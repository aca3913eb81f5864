"""Retry database work through a short outage (a Postgres restart) instead of losing the job."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, OperationalError

log = logging.getLogger(__name__)

T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    """A lost connection or a locked SQLite file: worth retrying. A bad statement is not."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if not isinstance(exc, OperationalError):
        return False
    text = str(exc.orig).lower()
    return not ("syntax error" in text or "no such" in text)


def with_db_retry(work: Callable[[], T], *, budget_s: float, what: str) -> T:
    """Run `work`, retrying transient database failures with backoff for up to `budget_s`."""
    deadline = time.monotonic() + budget_s
    delay = 0.5
    while True:
        try:
            return work()
        except DBAPIError as exc:
            if not is_transient(exc) or time.monotonic() + delay > deadline:
                raise
            log.warning("%s: database unavailable (%s); retrying in %.1fs", what, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
