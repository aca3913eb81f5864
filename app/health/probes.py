"""Readiness probes of the database and the broker, each bounded to about a second."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import redis
from kombu import Connection
from sqlalchemy import Engine

from app.core.settings import Settings
from app.health.repository import ping

PROBE_TIMEOUT_S = 1.5
_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="readyz")


def _broker_ok(settings: Settings) -> None:
    url = settings.resolved_broker_url
    if url.startswith("filesystem://"):
        folder = settings.broker_folder / "queue"
        if not (folder.is_dir() and os.access(folder, os.W_OK)):
            raise RuntimeError(f"broker folder {folder} is not writable")
    elif url.startswith(("redis://", "rediss://")):
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        try:
            client.ping()
        finally:
            client.close()
    else:
        with Connection(url, connect_timeout=1) as conn:
            conn.ensure_connection(max_retries=1, timeout=1)


def _outcome(future: Future[None], deadline: float) -> str:
    try:
        future.result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        return "timed out"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    return "ok"


def readiness(engine: Engine, settings: Settings) -> dict[str, str]:
    """{"database": "ok" | reason, "broker": "ok" | reason}; both probes run concurrently and
    the answer comes within PROBE_TIMEOUT_S even when a server hangs."""
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    db = _pool.submit(ping, engine)
    broker = _pool.submit(_broker_ok, settings)
    return {"database": _outcome(db, deadline), "broker": _outcome(broker, deadline)}
