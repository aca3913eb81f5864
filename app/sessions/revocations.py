"""A revoked key is refused at once by every API process, despite their key caches.

Each API process trusts a key it verified for KEY_CACHE_TTL_S (app.sessions.service), so most
requests cost no database lookup. A revocation, or a sign-out, bumps one counter in Redis (after
its commit); a cached verification is trusted only while the counter still reads what it read
before that key was looked up. So the next request of a revoked key, in any process, is looked
up again and refused, however fresh its cache entry. Reading the counter first and bumping it
after the commit leaves no gap: a lookup that saw the key valid ran before the commit, so
before the bump, and its entry carries the older value.

Without Redis (the embedded default: one API process on SQLite) nothing is cached: every request
looks its key up in the database, an in-process read, so a revocation made by another process
(`grpo keys revoke`) holds at once too. When Redis does not answer, the caches are not trusted
for BACKOFF_S (requests look their keys up); a bump that fails leaves other processes to drop
their entries within KEY_CACHE_TTL_S, as before.
"""

from __future__ import annotations

import functools
import logging
import time

import redis

log = logging.getLogger(__name__)

EPOCH_KEY = "grpo:api-keys:revocations"
BACKOFF_S = 5.0  # after a failed read, look keys up without asking Redis for this long


class RevocationEpoch:
    """The shared revocation counter (None where there is none to read)."""

    def __init__(self, redis_url: str | None) -> None:
        self._client = (
            redis.Redis.from_url(redis_url, socket_connect_timeout=0.5, socket_timeout=0.5)
            if redis_url
            else None
        )
        self._down_until = 0.0

    def read(self) -> int | None:
        """The counter now; None when a cached verification must not be trusted (no Redis, or
        Redis not answering)."""
        if self._client is None or time.monotonic() < self._down_until:
            return None
        try:
            value = self._client.get(EPOCH_KEY)
            return int(value) if value is not None else 0
        except (redis.RedisError, OSError, ValueError) as exc:
            if time.monotonic() >= self._down_until:
                log.warning("Redis unavailable: every API key is looked up until it is: %s", exc)
            self._down_until = time.monotonic() + BACKOFF_S
            return None

    def bump(self) -> None:
        """After a committed revocation or sign-out: every cached verification is stale."""
        if self._client is None:
            return
        try:
            self._client.incr(EPOCH_KEY)
        except (redis.RedisError, OSError) as exc:
            log.warning(
                "could not tell the other API processes of a key revocation (Redis: %s); "
                "their cached keys expire within seconds",
                exc,
            )


@functools.lru_cache(maxsize=8)
def revocation_epoch(redis_url: str | None) -> RevocationEpoch:
    """This process's one client of the counter at `redis_url` (the settings' Redis)."""
    return RevocationEpoch(redis_url)
