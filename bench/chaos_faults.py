"""The chaos run's faults (bench.chaos): which kinds, their weights, and the injector that
hits the cluster (bench.chaos_cluster) one fault at a time, each chosen and timed by the run's
seeded generator. A fault that finds nothing to hit (no async job's rollout server running) is
recorded as skipped, not counted.
"""

from __future__ import annotations

import random
import signal
import time
from typing import Any

from bench.chaos_cluster import SETTINGS, Cluster
from bench.chaos_jobs import MIXES

WEIGHTS = {
    "worker_kill9": 3,
    "worker_term": 2,
    "worker_pause": 2,
    "redis_restart": 1,
    "postgres_restart": 1,
    "rollout_server_kill9": 2,
    "inference_kill9": 1,
}
# A fault that found nothing to hit (no async job running) is tried again later, this often.
RETRIES = 3
ROLLOUT_SERVER_WAIT_S = 20.0


class Faults:
    """The fault injector: one fault at a time, each chosen and timed by `rng`."""

    def __init__(self, cluster: Cluster, rng: random.Random, log: list[dict[str, Any]]) -> None:
        self.cluster = cluster
        self.rng = rng
        self.log = log
        self.t0 = time.monotonic()

    def _skip(self, kind: str, why: str) -> bool:
        entry = {"t": round(time.monotonic() - self.t0, 1), "kind": kind, "skipped": why}
        self.log.append(entry)
        print(f"[chaos {entry['t']:7.1f}s] {kind} skipped: {why}", flush=True)
        return False

    def _record(self, kind: str, **detail: Any) -> None:
        entry = {"t": round(time.monotonic() - self.t0, 1), "kind": kind, **detail}
        self.log.append(entry)
        print(f"[chaos {entry['t']:7.1f}s] {kind} {detail}", flush=True)

    def _pick_worker(self) -> int:
        """A worker slot, preferring one that holds a lease (a fault that hits a running job)."""
        try:
            holders = self.cluster.lease_holders()
        except Exception:  # the database may be down right now: any worker will do
            holders = {}
        busy = [
            slot
            for slot in range(len(self.cluster.workers))
            if self.cluster.worker_name(slot) in holders
        ]
        if busy and self.rng.random() < 0.8:
            return self.rng.choice(busy)
        return self.rng.randrange(len(self.cluster.workers))

    def inject(self, kind: str) -> bool:
        """Inject `kind`; False when it found nothing to hit (recorded as skipped)."""
        return getattr(self, kind)() is not False

    def worker_kill9(self) -> None:
        slot = self._pick_worker()
        worker = self.cluster.workers[slot]
        assert worker is not None
        group = self.rng.random() < 0.5
        name = self.cluster.worker_name(slot)
        if worker.proc is not None:
            self.cluster.watch_children(name, worker.pid)
        if group:
            worker.send(signal.SIGKILL)
        elif worker.proc is not None:
            worker.proc.send_signal(signal.SIGKILL)
        if worker.proc is not None:
            worker.proc.wait()
        time.sleep(self.rng.uniform(0.5, 3.0))
        self.cluster.start_worker(slot)
        self._record("worker_kill9", worker=name, whole_group=group)

    def worker_term(self) -> None:
        slot = self._pick_worker()
        worker = self.cluster.workers[slot]
        assert worker is not None
        name = self.cluster.worker_name(slot)
        started = time.monotonic()
        if worker.proc is not None:
            # To the worker alone, as `docker stop` does: it hands its job back and exits.
            worker.proc.send_signal(signal.SIGTERM)
        # The grace period of the compose file is longer than the trainer's stop grace, so is
        # this one; past it, the worker is killed as Docker would.
        status = worker.wait(SETTINGS["stop_grace_seconds"] + 30)
        if status is None:
            worker.stop(signal.SIGKILL)
        took = round(time.monotonic() - started, 1)
        self.cluster.start_worker(slot)
        self._record("worker_term", worker=name, exit_status=status, exit_s=took)

    def worker_pause(self) -> None:
        slot = self._pick_worker()
        worker = self.cluster.workers[slot]
        assert worker is not None
        name = self.cluster.worker_name(slot)
        # The whole group (worker and its heartbeat process): a frozen machine, so the lease
        # expires and another worker takes the job; the paused one must not write on waking.
        pause = SETTINGS["lease_seconds"] + SETTINGS["maintenance_seconds"] + self.rng.uniform(2, 6)
        worker.send(signal.SIGSTOP)
        time.sleep(pause)
        worker.send(signal.SIGCONT)
        self._record("worker_pause", worker=name, paused_s=round(pause, 1))

    def redis_restart(self) -> None:
        down = self.rng.uniform(1.0, 5.0)
        self.cluster.redis.stop(signal.SIGKILL)
        time.sleep(down)
        self.cluster.redis.start()
        self._record("redis_restart", down_s=round(down, 1))

    def postgres_restart(self) -> None:
        mode = self.rng.choice(["immediate", "fast"])
        down = self.rng.uniform(1.0, 5.0)
        self.cluster.pg.stop(mode)
        time.sleep(down)
        self.cluster.pg.start()
        self._record("postgres_restart", mode=mode, down_s=round(down, 1))

    def rollout_server_kill9(self) -> bool:
        """kill -9 of a running async job's rollout server, mid-run (one that is ready: a
        server killed while it starts fails its job, see RELIABILITY.md), preferring a
        worker that holds a lease: its trainer starts a new one, which loads the call's
        version from the files; the job goes on, no step lost or written twice (the checks)."""
        deadline = time.monotonic() + ROLLOUT_SERVER_WAIT_S
        while not (found := self.cluster.rollout_servers()):
            if time.monotonic() >= deadline:
                return self._skip("rollout_server_kill9", "no async job's server ready")
            time.sleep(1.0)
        try:
            holders = self.cluster.lease_holders()
        except Exception:  # the database may be down
            holders = {}
        leased = [s for s in sorted(found) if self.cluster.worker_name(s) in holders]
        slot = self.rng.choice(leased or sorted(found))
        server = self.rng.choice(sorted(found[slot], key=lambda p: p.pid))
        name = self.cluster.worker_name(slot)
        try:
            age = round(time.time() - server.create_time(), 1)
            server.kill()  # SIGKILL
        except Exception as exc:  # it ended between the look and the kill
            return self._skip("rollout_server_kill9", f"the server was gone: {exc!r}")
        self._record(
            "rollout_server_kill9", worker=name, job=holders.get(name), pid=server.pid, age_s=age
        )
        return True

    def inference_kill9(self) -> bool:
        """kill -9 of the `grpo inference` process (restarted, as compose restarts it; its
        engines' guards take the engines down with it) or of one of its vLLM servers (the
        process starts it again at the next ensure)."""
        inference = self.cluster.inference
        if inference is None:
            return self._skip("inference_kill9", "no inference process in this run")
        engines = self.cluster.engine_servers()
        if engines and self.rng.random() < 0.5:
            engine = self.rng.choice(sorted(engines, key=lambda p: p.pid))
            self.cluster.watch_children("inference engine", engine.pid)
            try:
                engine.kill()
            except Exception as exc:
                return self._skip("inference_kill9", f"the engine was gone: {exc!r}")
            self._record("inference_kill9", target="engine", pid=engine.pid)
            return True
        self.cluster.watch_children("inference process", inference.pid)
        if inference.proc is not None:
            inference.proc.send_signal(signal.SIGKILL)
            inference.proc.wait()
        time.sleep(self.rng.uniform(0.5, 3.0))
        restart = "ok"
        try:
            self.cluster.start_inference()
        except (TimeoutError, RuntimeError) as exc:  # the end's recovery check will say
            restart = f"failed: {exc}"[:500]
        self._record(
            "inference_kill9", target="process", engines_running=len(engines), restart=restart
        )
        return True


def fault_kinds(cluster: Cluster, mix: str) -> dict[str, int]:
    """The faults this run can inject, with their weights."""
    kinds = dict(WEIGHTS)
    if "async" not in MIXES[mix]:
        kinds.pop("rollout_server_kill9")
    if not cluster.inference_enabled:
        kinds.pop("inference_kill9")
    return kinds


def fault_window(
    cluster: Cluster, rng: random.Random, minutes: float, kinds_weights: dict[str, int]
) -> list[dict[str, Any]]:
    log: list[dict[str, Any]] = []
    faults = Faults(cluster, rng, log)
    kinds, weights = list(kinds_weights), list(kinds_weights.values())
    # Every kind once first (in a seeded order), so that even a short run covers them all; a
    # kind that found nothing to hit goes to the back of that list (RETRIES times); then
    # weighted draws.
    first = rng.sample(kinds, len(kinds))
    tries: dict[str, int] = {}
    end = time.monotonic() + minutes * 60
    while True:
        time.sleep(rng.uniform(3.0, 10.0))
        if time.monotonic() >= end:
            return log
        from_first = bool(first)
        kind = first.pop(0) if first else rng.choices(kinds, weights)[0]
        if not faults.inject(kind) and from_first:
            tries[kind] = tries.get(kind, 0) + 1
            if tries[kind] <= RETRIES:
                first.append(kind)
