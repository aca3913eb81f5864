"""Job creation under load: POST /v1/jobs at a fixed open-loop rate against `grpo api`.

    python -m bench.load_create --rate 200 --seconds 20 --api-workers 4

What runs: a fresh database on the local Postgres (migrated, one project and key), a private
redis-server as the broker (nothing consumes it: jobs just queue), `grpo api` with N processes
on a free port, and, in a separate process, the open-loop client of `bench.load_client`. Each
request is a small valid spec with its own Idempotency-Key (what `grpo submit` sends); the
fair-use limits are raised so that the run measures creation, not refusal (429s are counted
apart all the same). A short warm-up at a low rate runs first and is not counted.

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

from bench.common import RESULTS_DIR, load_snapshot, machine_info
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

# Far above what the run sends: the run measures creating jobs, not refusing them.
UNLIMITED = {
    "rate_limit_per_minute": 10_000_000,
    "rate_limit_burst": 1_000_000,
    "max_active_jobs_per_project": 10_000_000,
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
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


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
            "path": "/v1/jobs",
            "body": SPEC,
            "keys": keys,
            "idempotency": not args.no_idempotency,
            "max_connections": args.connections,
        }
        warm = run_client({**base, "run_id": "warm", "rate": 20, "seconds": args.warmup})
        before = load_snapshot()
        cpu0, wall0 = process_tree_cpu(api.pid), time.perf_counter()
        result = run_client({**base, "run_id": "run", "rate": args.rate, "seconds": args.seconds})
        api_cpu = (process_tree_cpu(api.pid) - cpu0) / (time.perf_counter() - wall0)
        after = load_snapshot()
        summary = result["summary"]
        stored = count_jobs(admin, database) - warm["summary"]["ok"]
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
        f"{args.rate:.0f} req/s for {args.seconds:.0f}s, {args.api_workers} API processes, "
        f"{args.projects} project(s): "
        f"ok {s['ok']}/{s['requests']}, 429 {s['rate_429']}, errors {s['errors']}, "
        f"achieved {s['achieved_ok_per_s']}/s; latency ms {s['latency_ms']}; "
        f"client lag p99 {s['client_send_lag_ms']['p99']} ms; API CPU {report['api_cpu_share']} "
        f"cores ({report['api_cpu_ms_per_request']} ms/request); jobs stored {report['jobs_stored']}; target met: {report['target']['met']}"
    )
    print(f"wrote {RESULTS_DIR / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
