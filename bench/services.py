"""The servers the service benchmarks run against, each of the benchmark's own: a Postgres
database (on the shared server, or a private cluster that can be stopped and started), a
private redis-server, the API (`grpo api`) and `grpo worker` processes.

Everything is a subprocess of the benchmark, started on a free port, and waited for until it
answers; nothing here touches a server another process uses, beyond creating and dropping one
database on the shared Postgres.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def sqlalchemy_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://", 1)


def create_database(admin_url: str, prefix: str) -> tuple[str, str]:
    """A fresh database on the server of `admin_url`, migrated; returns (name, SQLAlchemy URL)."""
    import psycopg

    from grpo_cli import db as migrations

    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = sqlalchemy_url(f"{admin_url.rsplit('/', 1)[0]}/{name}")
    migrations.upgrade(url)
    return name, url


def drop_database(admin_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def create_project_key(database_url: str, project: str) -> str:
    """A new API key (plaintext) for `project`, created through the service's own code."""
    from app.core.db import make_engine, make_session_factory, session_scope
    from app.sessions.service import create_key

    engine = make_engine(database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            return create_key(session, project, "bench").plaintext
    finally:
        engine.dispose()


def _pg_bin(tool: str) -> str:
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{tool}"))
    if found:
        return str(found[-1])
    path = shutil.which(tool)
    if path is None:
        raise FileNotFoundError(f"PostgreSQL's {tool} not found (looked in /usr/lib/postgresql)")
    return path


class PrivatePostgres:
    """A Postgres cluster of our own (initdb in a temporary folder, its own port and socket
    folder), so the chaos run can stop and start it without touching the shared server. As
    root, the tools run as the `postgres` user (initdb refuses root)."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder = folder
        self.data = folder / "pgdata"
        self.port = port
        self.log = folder / "postgres.log"
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            self._as_user = ["runuser", "-u", "postgres", "--"]
            folder.mkdir(parents=True, exist_ok=True)
            shutil.chown(folder, "postgres", "postgres")

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        subprocess.run([*self._as_user, *args], check=True, capture_output=True, timeout=120)

    def init(self) -> None:
        self._run(
            _pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            _pg_bin("pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        """`immediate` is a crash (no checkpoint, clients cut off); `fast` a clean shutdown."""
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)


class Redis:
    """A private redis-server; with `data_dir` it keeps an append-only file there, so queued
    messages survive its restart (as the production compose file configures it)."""

    def __init__(self, port: int, data_dir: Path | None = None) -> None:
        self.port = port
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_connect_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        if self.data_dir is None:
            args += ["--appendonly", "no"]
        else:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            args += ["--dir", str(self.data_dir), "--appendonly", "yes"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        wait_for(self._answers, 15, f"redis-server on port {self.port}")

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        self.proc = None


class Process:
    """A `python -m grpo_cli <args>` child with its output in a log file."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.args = args
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "grpo_cli", *self.args],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own process group: a signal to the group reaches uvicorn's worker
                # processes too, and nothing we send leaks to the benchmark itself.
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, sig: int) -> None:
        if self.alive():
            os.killpg(self.pid, sig)

    def wait(self, timeout: float) -> int | None:
        """The exit status once it exits within `timeout` seconds, else None."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        """Send `sig` to the process group; kill it if it is not gone after `timeout`."""
        if self.proc is None:
            return None
        if self.alive():
            os.killpg(self.pid, signal.SIGCONT)  # a paused process cannot act on TERM
            os.killpg(self.pid, sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def service_env(
    database_url: str, broker_url: str, queue: str, data_dir: Path, **settings: object
) -> dict[str, str]:
    """The environment of an API or worker process: our servers, plus GRPO_<NAME> for each
    extra setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_")}
    env.update(
        GRPO_DATABASE_URL=database_url,
        GRPO_BROKER_URL=broker_url,
        GRPO_QUEUE_NAME=queue,
        GRPO_DATA_DIR=str(data_dir),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    env.update({f"GRPO_{name.upper()}": str(value) for name, value in settings.items()})
    return env


def start_api(
    env: dict[str, str], port: int, workers: int, log_path: Path, access_log: bool = False
) -> Process:
    """`grpo api` (the production entry) on `port`; returns once /healthz answers."""
    args = ["api", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)]
    if not access_log:
        args.append("--no-access-log")
    api = Process(args, env, log_path)
    api.start()

    def healthy() -> bool:
        if not api.alive():
            raise RuntimeError(f"the API exited:\n{api.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    wait_for(healthy, 60, "the API's /healthz")
    return api
