"""The live tail of a job: workers append a notification to a Redis stream after each committed
write; the SSE endpoint blocks on that stream so new data reaches clients at once. The records
themselves are always read from the database, so a reconnecting client can never miss one."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis
import redis.asyncio as aioredis

log = logging.getLogger(__name__)

STREAM_MAXLEN = 200
STREAM_TTL_S = 24 * 3600


def stream_key(job_id: str) -> str:
    return f"grpo:job:{job_id}:tail"


class TailPublisher:
    """Used by workers. Never raises: a Redis outage slows live updates, it loses nothing."""

    def __init__(self, url: str | None) -> None:
        self._client = (
            redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1) if url else None
        )

    def notify(self, job_id: str, kind: str) -> None:
        if self._client is None:
            return
        key = stream_key(job_id)
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.xadd(key, {"kind": kind}, maxlen=STREAM_MAXLEN, approximate=True)
            pipe.expire(key, STREAM_TTL_S)
            pipe.execute()
        except redis.RedisError as exc:
            log.debug("live tail notify failed: %s", exc)


class TailWaiter:
    """Used by the SSE endpoint: wait until something new is appended, or a timeout."""

    def __init__(self, url: str | None, job_id: str) -> None:
        self._key = stream_key(job_id)
        self._last_id = "$"
        self._client = (
            aioredis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=None)
            if url
            else None
        )

    async def wait(self, timeout_s: float) -> None:
        if self._client is None:
            await asyncio.sleep(timeout_s)
            return
        try:
            result = await self._client.xread(
                {self._key: self._last_id}, count=100, block=max(1, int(timeout_s * 1000))
            )
        except (redis.RedisError, OSError):
            await asyncio.sleep(timeout_s)  # Redis down: fall back to polling the database
            return
        for stream in result or []:  # [(key, [(entry id, fields), ...]), ...]
            entries: list[Any] = list(stream[1])  # type: ignore[arg-type]
            if entries:
                last = entries[-1][0]
                self._last_id = last.decode() if isinstance(last, bytes) else str(last)

    async def close(self) -> None:
        if self._client is not None:
            try:
                await self._client.aclose()
            except Exception:
                log.debug("closing live tail client failed", exc_info=True)
