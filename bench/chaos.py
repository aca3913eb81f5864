"""A chaos run anyone can repeat: real processes, real faults, then every invariant checked.

    python -m bench.chaos --minutes 10 --seed 1

It starts its own Postgres cluster and redis-server, the API (`grpo api`, 2 processes) and
three `grpo worker` processes (bench.chaos_cluster), submits 30 small jobs over three projects
(tiny model, transformers engine, checkpoints every 2 steps, so that resumes happen), and for
`--minutes` injects faults chosen by a seeded random generator: kill -9 of a worker (the worker
process alone, as `docker kill` does, or its whole process group, as a lost machine does),
SIGTERM of a worker (a deployment), a worker frozen past its lease (SIGSTOP of its process
group, SIGCONT after lease + margin), a Redis crash and a Postgres crash (each restarted), and
it cancels a few jobs. A thread polls the API throughout and records its latency. Then every
server is brought back, the remaining jobs get `--drain-minutes` to finish, and the rows are
checked (bench.chaos_checks). Exit status 1 on any violation.

Writes `bench/results/chaos_seed<N>_<M>m.json`; the run's folder (logs) is kept on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.chaos_checks import check_run
from bench.chaos_cluster import SETTINGS, Cluster
from bench.chaos_traffic import Traffic
from bench.common import RESULTS_DIR, load_snapshot, machine_info

WEIGHTS = {
    "worker_kill9": 3,
    "worker_term": 2,
    "worker_pause": 2,
    "redis_restart": 1,
    "postgres_restart": 1,
}


class Faults:
    """The fault injector: one fault at a time, each chosen and timed by `rng`."""

    def __init__(self, cluster: Cluster, rng: random.Random, log: list[dict[str, Any]]) -> None:
        self.cluster = cluster
        self.rng = rng
        self.log = log
        self.t0 = time.monotonic()

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

    def inject(self, kind: str) -> None:
        getattr(self, kind)()

    def worker_kill9(self) -> None:
        slot = self._pick_worker()
        worker = self.cluster.workers[slot]
        assert worker is not None
        group = self.rng.random() < 0.5
        name = self.cluster.worker_name(slot)
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


def fault_window(cluster: Cluster, rng: random.Random, minutes: float) -> list[dict[str, Any]]:
    log: list[dict[str, Any]] = []
    faults = Faults(cluster, rng, log)
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
    # Every kind once first (in a seeded order), so that even a short run covers them all;
    # then weighted draws.
    first = rng.sample(kinds, len(kinds))
    end = time.monotonic() + minutes * 60
    while True:
        time.sleep(rng.uniform(3.0, 10.0))
        if time.monotonic() >= end:
            return log
        faults.inject(first.pop(0) if first else rng.choices(kinds, weights)[0])


def read_rows(cluster: Cluster) -> dict[str, list[dict[str, Any]]]:
    return {
        "jobs": cluster.rows("SELECT id, project_id, status, total_steps, attempt FROM jobs"),
        "events": cluster.rows(
            "SELECT id, job_id, attempt, type, data, created_at FROM job_events"
        ),
        "metrics": cluster.rows("SELECT job_id, step, attempt, created_at FROM job_metrics"),
        "checkpoints": cluster.rows("SELECT job_id, step, attempt, created_at FROM checkpoints"),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix=f"grpo-chaos-{args.seed}-"))
    root.chmod(0o755)  # the private Postgres runs as the postgres user (when we are root)
    cluster = Cluster(root, workers=args.workers)
    summary: dict[str, Any] = {
        "benchmark": "chaos",
        "command": " ".join(["python -m bench.chaos", *sys.argv[1:]]),
        "seed": args.seed,
        "minutes": args.minutes,
        "machine": machine_info(),
        "load_before": load_snapshot(),
        "settings": SETTINGS,
        "folder": str(root),
    }
    traffic: Traffic | None = None
    ok = False
    try:
        started = time.monotonic()
        cluster.start()
        # About as much training as three workers do in the window, so faults keep landing
        # on running jobs; the drain finishes the rest.
        steps = max(10, int(8 * args.minutes)) if args.steps is None else args.steps
        traffic = Traffic(
            cluster,
            random.Random(rng.random()),
            jobs=args.jobs,
            steps=steps,
            window_s=args.minutes * 60,
            cancels=args.cancels,
        )
        traffic.start()
        faults = fault_window(cluster, rng, args.minutes)
        window_end = time.monotonic()
        traffic.mark("drain")
        cluster.ensure_up()
        drained = traffic.wait_all_finished(args.drain_minutes * 60)
        finished = time.monotonic()
        traffic.stop()
        for worker in cluster.workers:  # nothing writes while the rows are read
            if worker is not None:
                worker.stop(signal.SIGTERM, timeout=30)
        rows = read_rows(cluster)
        report = check_run(
            rows["jobs"], rows["events"], rows["metrics"], rows["checkpoints"], traffic.cancelled
        )
        ok = report.ok and drained and len(rows["jobs"]) == args.jobs
        counts: dict[str, int] = {}
        for fault in faults:
            counts[fault["kind"]] = counts.get(fault["kind"], 0) + 1
        summary.update(
            passed=ok,
            all_jobs_finished_in_drain=drained,
            jobs=len(rows["jobs"]),
            jobs_submitted=len(traffic.job_ids),
            submit_errors=traffic.errors,
            steps_per_job=steps,
            statuses=report.statuses,
            cancelled_by_run=sorted(traffic.cancelled),
            attempts_per_job=report.attempts,
            lost=report.lost,
            duplicated=report.duplicated,
            metrics_rows=len(rows["metrics"]),
            violations=[str(v) for v in report.violations[:200]],
            violation_count=len(report.violations),
            faults_by_kind=counts,
            faults=faults,
            api=traffic.latency_summary(),
            seconds={
                "setup_and_window": round(window_end - started, 1),
                "drain": round(finished - window_end, 1),
            },
            load_after=load_snapshot(),
        )
        return summary
    finally:
        if traffic is not None:
            traffic.stop()
        cluster.destroy()
        summary["passed"] = ok
        if ok and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the fault window")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=30)
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="mean steps per job (default: 8 per minute of window, at least 10)",
    )
    parser.add_argument("--cancels", type=int, default=3, help="jobs the run cancels")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--drain-minutes", type=float, default=15.0)
    parser.add_argument("--keep", action="store_true", help="keep the run's folder (logs)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    summary = run(args)
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"chaos_seed{args.seed}_{args.minutes:g}m.json"
    out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    api = summary.get("api", {})
    print(
        f"chaos seed {args.seed}, {args.minutes:g} min: {'PASSED' if summary['passed'] else 'FAILED'}"
        f"; faults {summary.get('faults_by_kind')}; jobs {summary.get('statuses')}; "
        f"lost {summary.get('lost')}, duplicated {summary.get('duplicated')}, "
        f"violations {summary.get('violation_count')}; API during faults {api.get('window')}"
    )
    for line in summary.get("violations", [])[:20]:
        print(f"  violation: {line}")
    if not summary["passed"]:
        print(f"logs kept in {summary['folder']}")
    print(f"wrote {out}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
