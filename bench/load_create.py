"""Job creation under load: POST /v1/jobs at a fixed open-loop rate against `grpo api`.

    python -m bench.load_create --rate 200 --seconds 20 --api-workers 4

What runs: a fresh database on the local Postgres (migrated, one project and key), a private
redis-server as the broker (nothing consumes it: jobs just queue), `grpo api` with N processes
on a free port, and, in a separate process, the open-loop client of `bench.load_client`. Each
request is a small valid spec with its own Idempotency-Key (what `grpo submit` sends); the
fair-use limits are raised so that the run measures creation, not refusal (429s are counted
apart all the same). A short warm-up at a low rate runs first and is not counted.

`--path /v1/jobs/validate` sends the same requests to the dry run instead, which does all that
a create does but write (key, rate limit, spec validation, admission, the answer): what the
HTTP stack and the checks cost without the database work.

Where the CPU goes: the run reads the CPU time of the API processes, of the Postgres backends
serving the benchmark's database, of the private redis-server and of the client, before and
after the timed run, and reports each per answered request; and how busy the whole machine was
(so CPU taken by other work on the machine shows as `other`).

Output: a summary on stdout and `bench/results/load_create[_<label>].json`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, load_snapshot, machine_info, system_cpu_ticks
from bench.services import (
    DEFAULT_PG_ADMIN,
    Process,
    Redis,
    create_database,
    create_project_key,
    drop_database,
    free_port,
    service_env,
    start_api,
)

# A small valid job spec: the tiny test model, generated prompts, a few steps.
SPEC: dict[str, Any] = {
    "model": "tiny-random-llama",
    "dataset": {"generator": {"type": "arithmetic", "count": 16}},
    "graders": [{"type": "numeric_match"}],
    "grpo": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
    "rollout": {"engine": "transformers"},
}

CREATE = "/v1/jobs"
DRY_RUN = "/v1/jobs/validate"

# Far above what the run sends: the run measures creating jobs, not refusing them.
UNLIMITED = {
    "rate_limit_per_minute": 10_000_000,
    "rate_limit_burst": 1_000_000,
    "max_active_jobs_per_project": 10_000_000,
    "max_active_devices_per_project": 10_000_000,
}


def run_client(config: dict[str, Any]) -> dict[str, Any]:
    """The load process: its own interpreter, so its CPU is not the API's nor ours."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.load_client"],
        input=json.dumps(config),
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    return dict(json.loads(out.stdout))


def _cpu_seconds(proc: Any) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def process_tree_cpu(pid: int) -> float:
    """CPU seconds used so far by a process and its children (the uvicorn workers)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            total += _cpu_seconds(proc)
        except psutil.NoSuchProcess:
            continue
    return total


def postgres_backends_cpu(database: str) -> float:
    """CPU seconds used so far by the Postgres backends connected to `database` (their process
    titles name it). Backends that exited during the window are missed: the API's pools keep
    theirs open for the whole run, so that is at most an overflow connection or two."""
    import psutil

    total = 0.0
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            title = " ".join(proc.info["cmdline"] or [])
            if proc.info["name"] == "postgres" and f" {database} " in f" {title} ":
                total += _cpu_seconds(proc)
        except psutil.Error:
            continue
    return total


def machine_busy_cpu() -> float:
    """CPU seconds the whole machine spent on anything but idle and I/O wait, so far."""
    ticks = system_cpu_ticks()
    busy = sum(v for k, v in ticks.items() if k not in ("idle", "iowait"))
    return busy / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds of each party to the run, between `start` and `stop`."""

    def __init__(self, api_pid: int, redis_pid: int, database: str) -> None:
        self.api_pid, self.redis_pid, self.database = api_pid, redis_pid, database
        self.before: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        return {
            "api": process_tree_cpu(self.api_pid),
            "postgres": postgres_backends_cpu(self.database),
            "redis": process_tree_cpu(self.redis_pid),
            "machine": machine_busy_cpu(),
            "wall": time.perf_counter(),
        }

    def start(self) -> None:
        self.before = self._read()

    def stop(self) -> dict[str, float]:
        after = self._read()
        return {k: after[k] - self.before[k] for k in after}


def cpu_breakdown(used: dict[str, float], client_cpu_s: float, answered: int) -> dict[str, Any]:
    """Cores used during the run and CPU milliseconds per answered request, by party; `other`
    is what the rest of the machine used meanwhile (other work, the kernel's share of ours)."""
    wall = used["wall"]
    parties = {
        "api": used["api"],
        "postgres": used["postgres"],
        "redis": used["redis"],
        "client": client_cpu_s,
    }
    parties["other"] = max(0.0, used["machine"] - sum(parties.values()))
    per_request = {k: round(v * 1000 / max(1, answered), 2) for k, v in parties.items()}
    per_request["ours"] = round(sum(v for k, v in per_request.items() if k != "other"), 2)
    return {
        "cores": {k: round(v / wall, 2) for k, v in parties.items()}
        | {"machine_busy": round(used["machine"] / wall, 2)},
        "ms_per_request": per_request,
    }


def count_jobs(admin_url: str, database: str) -> int:
    import psycopg

    url = f"{admin_url.rsplit('/', 1)[0]}/{database}"
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM jobs WHERE name LIKE 'load-%'").fetchone()
    return int(row[0]) if row else 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    admin = os.environ.get("GRPO_BENCH_PG_ADMIN", DEFAULT_PG_ADMIN)
    folder = Path(tempfile.mkdtemp(prefix="grpo-load-"))
    database, url = create_database(admin, "grpo_load")
    redis = Redis(free_port())
    api: Process | None = None
    try:
        redis.start()
        # One key per project: creates of one project serialise on its row lock (the
        # per-project quotas are counted under it), so `--projects` shows that cost apart.
        keys = [
            create_project_key(url, f"load-{secrets.token_hex(3)}") for _ in range(args.projects)
        ]
        env = service_env(url, redis.url, "grpo-load", folder, **UNLIMITED)
        port = free_port()
        api = start_api(env, port, args.api_workers, folder / "api.log", args.access_log)
        base = {
            "host": "127.0.0.1",
            "port": port,
            "path": args.path,
            "body": SPEC,
            "keys": keys,
            "idempotency": not args.no_idempotency,
            "max_connections": args.connections,
        }
        warm = run_client({**base, "run_id": "warm", "rate": 20, "seconds": args.warmup})
        before = load_snapshot()
        assert redis.proc is not None
        meter = CpuMeter(api.pid, redis.proc.pid, database)
        meter.start()
        result = run_client({**base, "run_id": "run", "rate": args.rate, "seconds": args.seconds})
        used = meter.stop()
        api_cpu = used["api"] / used["wall"]
        after = load_snapshot()
        summary = result["summary"]
        cpu = cpu_breakdown(used, summary.pop("client_cpu_s"), summary["ok"])
        # (a dry run stores no job: its warm-up did not either)
        stored = count_jobs(admin, database) - (warm["summary"]["ok"] if args.path == CREATE else 0)
        return {
            "benchmark": "load_create",
            "label": args.label,
            "command": " ".join(["python -m bench.load_create", *sys.argv[1:]]),
            "machine": machine_info(),
            "config": {
                "rate_per_s": args.rate,
                "seconds": args.seconds,
                "api_workers": args.api_workers,
                "projects": args.projects,
                "path": args.path,
                "idempotency_key": not args.no_idempotency,
                "max_connections": args.connections,
                "access_log": args.access_log,
                "warmup": {"rate_per_s": 20, "seconds": args.warmup},
            },
            "summary": summary,
            "jobs_stored": stored,
            "api_cpu_share": round(api_cpu, 2),
            # CPU per answered request: comparable across runs that reached different rates.
            "api_cpu_ms_per_request": round(
                api_cpu * 1000 / max(1.0, summary["achieved_ok_per_s"] or 1.0), 2
            ),
            "cpu": cpu,
            "load_before": before,
            "load_after": after,
            "warmup_summary": warm["summary"],
            "latencies_ms_by_second": _per_second(result["samples"]),
        }
    finally:
        if api is not None:
            api.stop()
        redis.stop()
        drop_database(admin, database)


def _per_second(samples: list[list[float]]) -> list[dict[str, Any]]:
    """p50/p99 per second of the schedule: shows a warm-up tail or a stall mid-run."""
    from bench.load_client import percentile

    buckets: dict[int, list[float]] = {}
    for scheduled, latency, status in samples:
        if 200 <= status < 300:
            buckets.setdefault(int(scheduled), []).append(latency * 1000)
    return [
        {
            "second": s,
            "n": len(v),
            "p50": round(percentile(v, 50) or 0, 1),
            "p99": round(percentile(v, 99) or 0, 1),
        }
        for s, v in sorted(buckets.items())
    ]


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    from grpo_cli.api import default_workers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the timed run")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds at 20 req/s first")
    parser.add_argument("--api-workers", type=int, default=default_workers(), help="API processes")
    parser.add_argument("--connections", type=int, default=64, help="client connection limit")
    parser.add_argument(
        "--projects", type=int, default=1, help="spread the requests over this many projects"
    )
    parser.add_argument(
        "--path",
        choices=(CREATE, DRY_RUN),
        default=CREATE,
        help=f"{DRY_RUN}: the same requests as a dry run, which does all a create does (key, "
        "rate limit, spec validation, admission, answer) but write: the framework's share",
    )
    parser.add_argument("--no-idempotency", action="store_true", help="send no Idempotency-Key")
    parser.add_argument("--access-log", action="store_true", help="keep uvicorn's access log")
    parser.add_argument("--label", default="", help="suffix of the result file")
    parser.add_argument("--target-p99-ms", type=float, default=50.0)
    args = parser.parse_args(argv)
    # `timeout` and Ctrl-C: stop the API and drop the database on the way out (finally blocks).
    signal.signal(signal.SIGTERM, _exit_on_signal)
    report = measure(args)
    s = report["summary"]
    report["target"] = {
        "p99_ms": args.target_p99_ms,
        "met": s["errors"] == 0
        and s["rate_429"] == 0
        and (s["latency_ms"]["p99"] or 1e9) < args.target_p99_ms,
    }
    name = f"load_create_{args.label}.json" if args.label else "load_create.json"
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / name).write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"POST {args.path} at {args.rate:.0f} req/s for {args.seconds:.0f}s, {args.api_workers} API processes, "
        f"{args.projects} project(s): "
        f"ok {s['ok']}/{s['requests']}, 429 {s['rate_429']}, errors {s['errors']}, "
        f"achieved {s['achieved_ok_per_s']}/s; latency ms {s['latency_ms']}; "
        f"client lag p99 {s['client_send_lag_ms']['p99']} ms; API CPU {report['api_cpu_share']} "
        f"cores; CPU ms/request {report['cpu']['ms_per_request']}; machine busy "
        f"{report['cpu']['cores']['machine_busy']} cores; load "
        f"{report['load_before']['loadavg_1m']:.2f} -> {report['load_after']['loadavg_1m']:.2f}; "
        f"jobs stored {report['jobs_stored']}; target met: {report['target']['met']}"
    )
    print(f"wrote {RESULTS_DIR / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
