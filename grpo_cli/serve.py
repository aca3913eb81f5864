"""`grpo serve`: migrate, make sure a key exists, start an embedded worker process, serve the API."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.settings import Settings
from app.sessions.service import bootstrap_local_key
from grpo_cli import db

LOCAL_KEY_FILE = "api-key"


def ensure_local_key(settings: Settings) -> str | None:
    """Create the first key of an empty database, print it once, and keep a 0600 copy in the
    data folder so local tools can find it. Returns the new key, or None if keys exist."""
    engine = make_engine(settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            created = bootstrap_local_key(session)
    finally:
        engine.dispose()
    if created is None:
        return None
    path = settings.data_dir / LOCAL_KEY_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(created.plaintext + "\n")
    print(
        f"Created API key for project '{created.project_name}' (shown once, also saved to "
        f"{path.resolve()}):\n\n    {created.plaintext}\n",
        flush=True,
    )
    return created.plaintext


def start_worker_process(log_path: Path) -> subprocess.Popen[bytes]:
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_cli", "worker"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=os.environ.copy(),
    )


def serve(settings: Settings, host: str, port: int, embedded_worker: bool) -> int:
    import uvicorn

    from app.main import create_app

    db.upgrade(settings.resolved_database_url)
    ensure_local_key(settings)
    worker: subprocess.Popen[bytes] | None = None
    if embedded_worker:
        log_path = settings.data_dir / "worker.log"
        worker = start_worker_process(log_path)
        print(f"Embedded worker started (pid {worker.pid}, log {log_path.resolve()})", flush=True)
    print(f"API on http://{host}:{port} (docs at /docs)", flush=True)
    try:
        uvicorn.run(create_app(settings), host=host, port=port, log_level="info")
    finally:
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
    return 0
