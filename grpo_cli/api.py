"""`grpo api`: the production API entry point. Several uvicorn worker processes, no embedded
worker and no migration (a deployment runs `grpo db upgrade` once before, see
docker-compose.yml's `migrate` service).

Why several processes: the API's request handling is CPU-bound Python (spec validation, JSON,
SQLAlchemy), so one process saturates one core; measured in BENCHMARKS.md ("API: job creation
under load"). The count comes from `--workers`, else `GRPO_API_WORKERS`, else
`default_workers()`.
"""

from __future__ import annotations

import gc
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

API_WORKERS_ENV = "GRPO_API_WORKERS"
# Each process holds its own database pool (up to 20 connections, app.core.db.make_engine), so the
# count is bounded well below what a default Postgres (max_connections=100) can serve.
MAX_API_WORKERS = 32


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity; a container's cpuset counts)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def default_workers() -> int:
    """Two processes per core, at most four: a request waits on the database part of its time,
    so a core runs a second process's Python meanwhile; beyond four the gain is gone and each
    process costs its own memory and database connections."""
    return min(4, 2 * available_cores())


def parse_workers(value: str, source: str) -> int:
    """A process count from the command line or the environment, bounded; ValueError names
    the source."""
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"{source} must be a whole number, got {value!r}") from None
    if not 1 <= count <= MAX_API_WORKERS:
        raise ValueError(f"{source} must be between 1 and {MAX_API_WORKERS}, got {count}")
    return count


def resolve_workers(flag: int | None) -> int:
    """`--workers` wins, then GRPO_API_WORKERS, then the default."""
    if flag is not None:
        return parse_workers(str(flag), "--workers")
    env = os.environ.get("GRPO_API_WORKERS")
    if env is not None and env.strip():
        return parse_workers(env.strip(), API_WORKERS_ENV)
    return default_workers()


def create_app() -> FastAPI:
    """The factory each API process runs: the app, its database pools opened and warm
    (`app.core.state.warm_pools`: else the first burst after a start pays for new server backends
    inside requests), then every object alive at startup (modules, schemas, table metadata:
    most of the heap) frozen out of the garbage collector's reach.

    Without the freeze, each full (generation 2) collection walked all of them: about 100 ms
    during which no request of the process moved, and the p99 of job creation at 50 requests/s
    went from 24 ms to 209-270 ms (BENCHMARKS.md, "API: job creation under load")."""
    from app.core.state import warm_pools
    from app.main import create_app as build_app

    app = build_app()
    warm_pools(app.state.grpo)
    gc.collect()
    gc.freeze()
    return app


def run_api(host: str, port: int, workers: int, access_log: bool = True) -> int:
    import uvicorn

    print(f"API on http://{host}:{port} with {workers} worker process(es)", flush=True)
    # An import string and a factory: every worker process builds its own app (settings from
    # the environment, its own database pool), which uvicorn needs for workers > 1.
    uvicorn.run(
        "grpo_cli.api:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        access_log=access_log,
        log_level="info",
    )
    return 0
