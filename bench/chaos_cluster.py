"""The chaos run's deployment, all of its own: a private Postgres cluster and redis-server that
can be crashed and restarted, the API (`grpo api`, several processes), `grpo worker`
processes (one-device workers and a two-device one, `GRPO_WORKER_DEVICES=2`, whose jobs run
under torchrun as two gloo ranks on the CPU) and a `grpo inference` process serving the tiny
model, each restartable, with the short lease settings that make faults resolve in seconds.

The inference process is run as docker-compose runs it (restarted when it dies, with the same
server id and port, so its registry row is its own again): its engines (vLLM OpenAI servers
under their guard) start on demand, the base model's at start (`PRELOAD`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from app.core.job_status import LEASE_HOLDING_STATES
from bench.services import (
    PrivatePostgres,
    Process,
    Redis,
    create_project_key,
    free_port,
    service_env,
    sqlalchemy_url,
    start_api,
    wait_for,
)

# Faults must resolve in seconds, not minutes: a lost worker's job is re-queued 6 s after its
# last heartbeat, a message the broker lost is re-sent after 8 s. `max_attempts` is high because
# the run kills workers on purpose far more often than production would: a job running out of
# attempts would be the chaos budget speaking, not a bug. Fair-use limits are raised so that
# they never refuse the run's own polling; the per-project dispatch cap keeps its default, so
# fair dispatch is exercised too.
SETTINGS: dict[str, Any] = {
    "lease_seconds": 6,
    "heartbeat_seconds": 1,
    "maintenance_seconds": 2,
    "redispatch_seconds": 8,
    "max_attempts": 100,
    "db_retry_seconds": 120,
    "stop_grace_seconds": 30,
    "rate_limit_per_minute": 100_000,
    "rate_limit_burst": 10_000,
    "max_active_jobs_per_project": 1_000,
    "max_active_devices_per_project": 1_000,
}
# The two-device worker's own: a rank that dies ends its peer's collectives within this.
TWO_DEVICE_SETTINGS: dict[str, Any] = {"worker_devices": 2, "dist_timeout_s": 120}
MIB = 1024**2
# The inference process: one engine of the tiny model costs ~1.3 GB (docs/inference.md), so the
# budget holds two (the base, with the LoRA jobs' adapters, and one full fine-tune) with the
# default overhead; a small KV cache; LoRA rank 8 (the jobs' rank).
INFERENCE_SETTINGS: dict[str, Any] = {
    "inference_server_id": "chaos-inference",
    "inference_share_devices": 1,  # one CPU machine: engines beside the workers
    "inference_preload": "tiny-random-llama",
    "inference_kv_cache_bytes": 64 * MIB,
    "inference_memory_budget_bytes": 3584 * MIB,
    "inference_max_adapters": 4,
    "inference_max_lora_rank": 8,
}
ROLLOUT_SERVER = "trainer.rollout.rollout_server"
ENGINE_SERVER = "vllm.entrypoints.openai.api_server"


def descendants(proc: psutil.Process) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return list(proc.children(recursive=True))
    return []


class Cluster:
    def __init__(
        self,
        folder: Path,
        workers: int = 3,
        api_workers: int = 2,
        two_device_workers: int = 1,
        inference: bool = True,
    ) -> None:
        self.folder = folder
        self.data = folder / "data"
        self.pg = PrivatePostgres(folder / "pg", free_port())
        self.redis = Redis(free_port(), data_dir=folder / "redis")
        self.api_port = free_port()
        self.api_workers = api_workers
        self.api: Process | None = None
        slots = workers + two_device_workers
        self.workers: list[Process | None] = [None] * slots
        self.devices = [1] * workers + [2] * two_device_workers  # each slot's size class
        self.generation = [0] * slots  # restarts of each worker slot
        self.database_url = ""
        # The API and the inference process share this secret (GRPO_INFERENCE_TOKEN).
        self.inference_token = secrets.token_hex(16)
        self.inference_enabled = inference
        self.inference_port = free_port()
        self.inference: Process | None = None
        self.inference_generation = 0
        # Processes that were children of a process a fault killed: none may outlive it
        # (checked at the end, `orphans`).
        self.watched: list[tuple[str, psutil.Process]] = []

    # ---- start and stop --------------------------------------------------------------------

    def start(self) -> None:
        import psycopg

        from grpo_cli import db as migrations

        self.data.mkdir(parents=True, exist_ok=True)
        self.pg.init()
        self.pg.start()
        with psycopg.connect(self.pg.admin_url, autocommit=True) as conn:
            conn.execute("CREATE DATABASE grpo")
        self.database_url = sqlalchemy_url(self.pg.admin_url.rsplit("/", 1)[0] + "/grpo")
        migrations.upgrade(self.database_url)
        self.redis.start()
        self.api = start_api(
            self.env(), self.api_port, self.api_workers, self.folder / "api.log", access_log=False
        )
        if self.inference_enabled:
            self.start_inference()
        for slot in range(len(self.workers)):
            self.start_worker(slot)

    def env(self, **extra: Any) -> dict[str, str]:
        return service_env(
            self.database_url,
            self.redis.url,
            "grpo-chaos",
            self.data,
            **SETTINGS,
            inference_token=self.inference_token,
            **extra,
        )

    def new_key(self, project: str) -> str:
        return create_project_key(self.database_url, project)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def worker_name(self, slot: int) -> str:
        size = "" if self.devices[slot] == 1 else f"x{self.devices[slot]}"
        return f"chaos-w{slot}{size}-g{self.generation[slot]}"

    def start_worker(self, slot: int) -> None:
        self.generation[slot] += 1
        name = self.worker_name(slot)
        extra = TWO_DEVICE_SETTINGS if self.devices[slot] == 2 else {}
        env = self.env(worker_name=name, **extra)
        worker = Process(["worker"], env, self.folder / f"worker-{name}.log")
        worker.start()
        self.workers[slot] = worker

    # ---- the inference tier ------------------------------------------------------------------

    def start_inference(self) -> None:
        """`grpo inference` on its port (the same at every restart); returns once its control
        API answers /health (its engines start in the background)."""
        self.inference_generation += 1
        args = ["inference", "--port", str(self.inference_port), "--bases", "tiny-random-llama"]
        proc = Process(args, self.env(**INFERENCE_SETTINGS), self.folder / "inference.log")
        proc.start()
        self.inference = proc

        def healthy() -> bool:
            if not proc.alive():
                raise RuntimeError(f"grpo inference exited:\n{proc.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{self.inference_url}/health", timeout=1).status_code == 200
            return False

        wait_for(healthy, 120, "grpo inference's /health")

    @property
    def inference_url(self) -> str:
        return f"http://127.0.0.1:{self.inference_port}"

    def inference_engines_ready(self) -> list[str]:
        """The keys of the inference process's engines that are ready (its control API)."""
        response = httpx.get(
            f"{self.inference_url}/engines",
            headers={"X-Inference-Token": self.inference_token},
            timeout=10,
        )
        response.raise_for_status()
        return [e["key"] for e in response.json()["engines"] if e["status"] == "ready"]

    def wait_inference_ready(self, timeout_s: float) -> float:
        """Seconds until the preloaded base engine is ready."""
        started = time.monotonic()

        def ready() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return "tiny-random-llama" in self.inference_engines_ready()
            return False

        wait_for(ready, timeout_s, "the inference tier's base engine")
        return round(time.monotonic() - started, 1)

    def engine_servers(self) -> list[psutil.Process]:
        """The vLLM servers of our inference process (never anyone else's)."""
        if self.inference is None or not self.inference.alive():
            return []
        # The server's own command line (`python -m vllm...`), not its guard's, which holds
        # the server's command after `--`.
        return [
            p
            for p in descendants(psutil.Process(self.inference.pid))
            if _cmdline(p)[1:3] == ["-m", ENGINE_SERVER]
        ]

    def rollout_servers(self) -> dict[int, list[psutil.Process]]:
        """Worker slot -> the ready rollout servers among its worker's descendants (a server
        is ready once it wrote `ready.json` beside its config, the path it was started with:
        trainer.rollout.rollout_server.launch)."""
        found: dict[int, list[psutil.Process]] = {}
        for slot, worker in enumerate(self.workers):
            if worker is None or not worker.alive():
                continue
            servers = []
            for proc in descendants(psutil.Process(worker.pid)):
                command = _cmdline(proc)
                ours = command[1:3] == ["-m", ROLLOUT_SERVER] and len(command) > 3
                if ours and (Path(command[3]).parent / "ready.json").exists():
                    servers.append(proc)
            if servers:
                found[slot] = servers
        return found

    def watch_children(self, what: str, pid: int) -> None:
        """Remember the descendants of `pid` (about to be killed) to check they go too."""
        with contextlib.suppress(psutil.Error):
            self.watched += [(what, p) for p in descendants(psutil.Process(pid))]

    def orphans(self) -> list[str]:
        """The watched processes still running (psutil compares their start times too)."""
        left = []
        for what, proc in self.watched:
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{what}: pid {proc.pid} {' '.join(_cmdline(proc))[:200]}")
        return left

    def ensure_up(self) -> None:
        """Every server running again (after the fault window, before the drain)."""
        if self.redis.proc is None or self.redis.proc.poll() is not None:
            self.redis.start()
        with contextlib.suppress(Exception):
            self.pg.start()  # fails when it is already running
        for slot, worker in enumerate(self.workers):
            if worker is not None and worker.alive():
                os.killpg(worker.pid, signal.SIGCONT)
            else:
                self.start_worker(slot)
        if self.inference_enabled and (self.inference is None or not self.inference.alive()):
            self.start_inference()

    def stop(self) -> None:
        for worker in self.workers:
            if worker is not None:
                worker.stop(signal.SIGTERM, timeout=20)
        if self.inference is not None:
            self.inference.stop(signal.SIGTERM, timeout=60)  # it stops its engines first
        if self.api is not None:
            self.api.stop(signal.SIGTERM, timeout=20)
        self.redis.stop()

    def destroy(self) -> None:
        self.stop()
        self.pg.destroy()

    # ---- what the database says --------------------------------------------------------------

    def rows(self, query: str) -> list[dict[str, Any]]:
        import psycopg
        from psycopg.rows import dict_row

        url = self.pg.admin_url.rsplit("/", 1)[0] + "/grpo"
        with psycopg.connect(url, row_factory=dict_row, connect_timeout=5) as conn:
            return list(conn.execute(query).fetchall())  # type: ignore[arg-type]

    def lease_holders(self) -> dict[str, str]:
        """Worker name -> the job it holds a lease on (running, cancelling or pausing)."""
        states = ", ".join(f"'{s}'" for s in LEASE_HOLDING_STATES)  # constants, not user input
        rows = self.rows(
            f"SELECT id, lease_owner FROM jobs WHERE status IN ({states}) "
            "AND lease_owner IS NOT NULL"
        )
        return {str(r["lease_owner"]): str(r["id"]) for r in rows}


def _cmdline(proc: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return list(proc.cmdline())
    return []
