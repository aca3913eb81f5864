"""`grpo serve`: migrate, make sure a key exists, start an embedded worker process and an embedded
inference process (`grpo inference`), serve the API; stop both on exit."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.settings import Settings
from app.sessions.service import bootstrap_local_key
from grpo_cli import db

LOCAL_KEY_FILE = "api-key"
PR_SET_PDEATHSIG = 1


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
    return _start_cli_process("worker", log_path, os.environ.copy())


def start_inference_process(log_path: Path) -> subprocess.Popen[bytes]:
    """`grpo inference` beside the embedded worker. The embedded default is one machine by
    design, so its engines share the worker's device (serving.devices) on purpose."""
    env = os.environ.copy()
    env.setdefault("GRPO_INFERENCE_SHARE_DEVICES", "1")
    # A port of its own, so that several `grpo serve` on one machine do not collide; the
    # gateway finds it through the registry row.
    env.setdefault("GRPO_INFERENCE_PORT", str(_free_port()))
    return _start_cli_process("inference", log_path, env, die_with_parent=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_cli_process(
    command: str, log_path: Path, env: dict[str, str], *, die_with_parent: bool = False
) -> subprocess.Popen[bytes]:
    """`grpo <command>` with its output in ``log_path``. ``die_with_parent``: it gets SIGTERM
    when this process dies, however it dies (PR_SET_PDEATHSIG; Linux), so an inference process
    never outlives the `grpo serve` that started it and keeps a registry row fresh for nothing."""
    preexec = None
    if die_with_parent and sys.platform.startswith("linux"):
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        preexec = lambda: prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)  # noqa: E731
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_cli", command],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=preexec,
    )


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


def serve(
    settings: Settings,
    host: str,
    port: int,
    embedded_worker: bool,
    embedded_inference: bool = True,
) -> int:
    import uvicorn

    from app.main import create_app

    db.upgrade(settings.resolved_database_url)
    ensure_local_key(settings)
    worker: subprocess.Popen[bytes] | None = None
    inference: subprocess.Popen[bytes] | None = None
    try:
        if embedded_worker:
            log_path = settings.data_dir / "worker.log"
            worker = start_worker_process(log_path)
            print(
                f"Embedded worker started (pid {worker.pid}, log {log_path.resolve()})", flush=True
            )
        if embedded_inference:
            log_path = settings.data_dir / "inference.log"
            inference = start_inference_process(log_path)
            print(
                f"Embedded inference started (pid {inference.pid}, log {log_path.resolve()})",
                flush=True,
            )
        print(f"API on http://{host}:{port} (docs at /docs)", flush=True)
        uvicorn.run(create_app(settings), host=host, port=port, log_level="info")
    finally:
        # Both at once: each takes its own grace (a job checkpoints, engines stop).
        for process in (worker, inference):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        _stop(worker)
        _stop(inference)
    return 0
