"""`grpo serve`: migrate, make sure a key exists, start an embedded worker process and an embedded
inference process (`grpo inference`), serve the API; stop both on exit.

The children end with this process however it ends: SIGINT or SIGTERM (what docker, systemd and
supervisors send) stop them before it exits, and each has a parent-death signal, so a SIGKILL of
`grpo serve` (or any other death) sends them SIGTERM from the kernel.

The API and its embedded inference process share a token (GRPO_INFERENCE_TOKEN): the operator's,
or else one made at random for this run, so no other local process can reach the control API
and its engines (and load a checkpoint of any project)."""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

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


def start_inference_process(log_path: Path, token: str) -> subprocess.Popen[bytes]:
    """`grpo inference` beside the embedded worker, guarded by ``token`` (the API's
    ``inference_token``). The embedded default is one machine by design, so its engines share
    the worker's device (inference.devices) on purpose."""
    env = os.environ.copy()
    env["GRPO_INFERENCE_TOKEN"] = token
    env.setdefault("GRPO_INFERENCE_SHARE_DEVICES", "1")
    # A port of its own, so that several `grpo serve` on one machine do not collide; the
    # gateway finds it through the registry row.
    env.setdefault("GRPO_INFERENCE_PORT", str(_free_port()))
    return _start_cli_process("inference", log_path, env)


def embedded_inference_token(settings: Settings) -> str:
    """The token the API and its embedded inference process share: the operator's
    GRPO_INFERENCE_TOKEN, else a random one for this run. It lives only in the two processes
    (never on disk): each start of `grpo serve` starts its inference process anew."""
    return settings.inference_token or secrets.token_urlsafe(32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_cli_process(
    command: str, log_path: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """`grpo <command>` with its output in ``log_path``. It gets SIGTERM when this process dies,
    however it dies (PR_SET_PDEATHSIG; Linux), so neither a worker nor an inference process
    outlives the `grpo serve` that started it: a SIGTERM lets a worker checkpoint its job and
    hand it back, and an inference process stop its engines and remove its registry row."""
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_cli", command],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=_die_with_parent(os.getpid()) if sys.platform.startswith("linux") else None,
    )


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """What the child runs before exec: ask for SIGTERM on its parent's death. The kernel sends
    it when the thread that forked the child ends: serve() starts its children from the main
    thread, which lives as long as the process."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before the prctl: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


class _Terminated(Exception):
    """SIGTERM reached `grpo serve`."""


def _raise_terminated(_signum: int, _frame: FrameType | None) -> None:
    raise _Terminated


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
    if embedded_inference:
        token = embedded_inference_token(settings)
        settings = settings.model_copy(update={"inference_token": token})
    worker: subprocess.Popen[bytes] | None = None
    inference: subprocess.Popen[bytes] | None = None
    # uvicorn handles SIGTERM itself and, once its shutdown is done, restores this handler and
    # raises the signal again: with the default handler the process would die right there,
    # before the `finally` below stops the children. This one turns it into an exception.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    terminated = False
    try:
        if embedded_worker:
            log_path = settings.data_dir / "worker.log"
            worker = start_worker_process(log_path)
            print(
                f"Embedded worker started (pid {worker.pid}, log {log_path.resolve()})", flush=True
            )
        if embedded_inference:
            log_path = settings.data_dir / "inference.log"
            inference = start_inference_process(log_path, token)
            print(
                f"Embedded inference started (pid {inference.pid}, log {log_path.resolve()})",
                flush=True,
            )
        print(f"API on http://{host}:{port} (docs at /docs)", flush=True)
        uvicorn.run(create_app(settings), host=host, port=port, log_level="info")
    except _Terminated:
        terminated = True
    finally:
        # Both at once: each takes its own grace (a job checkpoints, engines stop).
        for process in (worker, inference):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        _stop(worker)
        _stop(inference)
        signal.signal(signal.SIGTERM, previous)
    if terminated:  # end as SIGTERM asked (exit status -15), now that the children are gone
        signal.raise_signal(signal.SIGTERM)
    return 0
