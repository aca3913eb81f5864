"""A chaos run anyone can repeat: real processes, real faults, then every invariant checked.

    python -m bench.chaos --minutes 10 --seed 1

It starts its own Postgres cluster and redis-server, the API (`grpo api`, 2 processes), three
one-device `grpo worker` processes and a two-device one, and a `grpo inference` process serving
the tiny model (bench.chaos_cluster). It submits 30 small jobs over three projects, a seeded mix
of kinds (bench.chaos_jobs: plain tiny jobs, LoRA jobs, async jobs with a rollout server of
their own, agent jobs with a python tool and environment, two-device jobs under torchrun; all
on the tiny model with checkpoints every 2 steps, so that resumes happen), and sends chat
completions through the API's gateway to the base model and to the models of the jobs that
succeeded (bench.chaos_inference). For `--minutes` it injects faults chosen by a seeded random
generator: kill -9 of a worker (the worker process alone, as `docker kill` does, or its whole
process group, as a lost machine does), SIGTERM of a worker (a deployment), a worker frozen
past its lease (SIGSTOP of its process group, SIGCONT after lease + margin), a Redis crash and
a Postgres crash (each restarted), kill -9 of an async job's rollout server (the trainer
restarts it), kill -9 of the inference process (restarted, as compose would) or of one of its
vLLM engines (it restarts it), and it cancels a few jobs. A thread polls the API throughout and
records its latency. Then every server is brought back, the remaining jobs get
`--drain-minutes` to finish, the inference tier must answer again, and the rows are checked
(bench.chaos_checks). Exit status 1 on any violation.

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

from bench.chaos_checks import Report, check_run, metric_values_sql
from bench.chaos_cluster import SETTINGS, Cluster
from bench.chaos_faults import fault_kinds, fault_window
from bench.chaos_jobs import MIXES
from bench.chaos_traffic import Traffic
from bench.common import RESULTS_DIR, load_snapshot, machine_info


def read_rows(cluster: Cluster) -> dict[str, list[dict[str, Any]]]:
    return {
        "jobs": cluster.rows(
            "SELECT id, project_id, status, total_steps, attempt, error_code, error_message "
            "FROM jobs"
        ),
        "events": cluster.rows(
            "SELECT id, job_id, attempt, type, data, created_at FROM job_events"
        ),
        # With the few values the per-kind checks read (bench.chaos_checks.KIND_METRICS).
        "metrics": cluster.rows(
            f'SELECT job_id, step, attempt, created_at, {metric_values_sql()} AS "values" '
            "FROM job_metrics m"
        ),
        "checkpoints": cluster.rows("SELECT job_id, step, attempt, created_at FROM checkpoints"),
    }


def _counts(values: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        out[value] = out.get(value, 0) + 1
    return out


def _summary_header(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The summary's fields known before the run starts."""
    return {
        "benchmark": "chaos",
        "command": " ".join(["python -m bench.chaos", *sys.argv[1:]]),
        "seed": args.seed,
        "minutes": args.minutes,
        "mix": args.mix,
        "machine": machine_info(),
        "load_before": load_snapshot(),
        "settings": SETTINGS,
        "folder": str(root),
    }


def _start_traffic(
    cluster: Cluster, rng: random.Random, args: argparse.Namespace, steps: int
) -> Traffic:
    """Submit, cancel, poll and chat for the fault window (its own generator, seeded from
    `rng`); started."""
    traffic = Traffic(
        cluster,
        random.Random(rng.random()),
        jobs=args.jobs,
        steps=steps,
        window_s=args.minutes * 60,
        cancels=args.cancels,
        mix=args.mix,
    )
    traffic.start()
    return traffic


def _read_and_check(
    cluster: Cluster, traffic: Traffic
) -> tuple[dict[str, list[dict[str, Any]]], Report]:
    """Stop the workers (nothing writes while the rows are read), read the rows, check them."""
    for worker in cluster.workers:
        if worker is not None:
            worker.stop(signal.SIGTERM, timeout=30)
    rows = read_rows(cluster)
    report = check_run(
        rows["jobs"],
        rows["events"],
        rows["metrics"],
        rows["checkpoints"],
        traffic.cancelled,
        kinds=traffic.kind_of,
    )
    return rows, report


def _passed(
    args: argparse.Namespace,
    report: Report,
    drained: bool,
    rows: dict[str, list[dict[str, Any]]],
    inference: dict[str, Any],
    recovered: dict[str, float | None],
    orphans: list[str],
) -> bool:
    """Whether the run passed: no violation, every job finished and present, the inference
    tier (if any) without violation and recovered, no process left behind."""
    inference_ok = not inference or (
        inference["violations"] == 0 and all(v is not None for v in recovered.values())
    )
    return report.ok and drained and len(rows["jobs"]) == args.jobs and inference_ok and not orphans


def _job_outcome(
    traffic: Traffic, rows: dict[str, list[dict[str, Any]]], report: Report, steps: int
) -> dict[str, Any]:
    """The summary's fields about the jobs: counts, statuses, attempts, failures, violations."""
    return {
        "jobs": len(rows["jobs"]),
        "jobs_submitted": len(traffic.job_ids),
        "jobs_by_kind": _counts(list(traffic.kind_of.values())),
        "submit_errors": traffic.errors,
        "steps_per_job": steps,
        "statuses": report.statuses,
        "statuses_by_kind": report.statuses_by_kind,
        "cancelled_by_run": sorted(traffic.cancelled),
        "attempts_per_job": report.attempts,
        "lost": report.lost,
        "duplicated": report.duplicated,
        "metrics_rows": len(rows["metrics"]),
        "rollout_server_restarts_seen": report.server_restarts,
        "failed_jobs": [
            {
                "id": r["id"],
                "kind": traffic.kind_of.get(str(r["id"]), "tiny"),
                "error_code": r["error_code"],
                "error_message": (r["error_message"] or "")[:1000],
            }
            for r in rows["jobs"]
            if r["status"] == "failed"
        ],
        "violations": [str(v) for v in report.violations[:200]],
        "violation_count": len(report.violations),
    }


def _fault_outcome(faults: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's fields about the faults: those that landed and those skipped, by kind."""
    landed = [f for f in faults if "skipped" not in f]
    return {
        "faults_by_kind": _counts([f["kind"] for f in landed]),
        "faults_skipped": _counts([f["kind"] for f in faults if "skipped" in f]),
        "faults": faults,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the cluster and traffic, inject faults for the window, drain, check every
    invariant; returns the summary (its folder removed when it passed, unless `--keep`)."""
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix=f"grpo-chaos-{args.seed}-"))
    root.chmod(0o755)  # the private Postgres runs as the postgres user (when we are root)
    cluster = Cluster(
        root,
        workers=args.workers,
        two_device_workers=args.two_device_workers if args.mix == "all" else 0,
        inference=not args.no_inference,
    )
    summary = _summary_header(args, root)
    traffic: Traffic | None = None
    ok = False
    try:
        started = time.monotonic()
        cluster.start()
        if cluster.inference_enabled:
            # The base engine up before the faults, so that the window's answers say how the
            # tier holds up, not how long its first start takes on this machine.
            summary["inference_ready_s"] = cluster.wait_inference_ready(args.inference_start_s)
        # About as much training as the workers do in the window, so faults keep landing
        # on running jobs; the drain finishes the rest.
        steps = max(10, int(8 * args.minutes)) if args.steps is None else args.steps
        traffic = _start_traffic(cluster, rng, args, steps)
        faults = fault_window(cluster, rng, args.minutes, fault_kinds(cluster, args.mix))
        window_end = time.monotonic()
        traffic.mark("drain")
        cluster.ensure_up()
        drained = traffic.wait_all_finished(args.drain_minutes * 60)
        finished = time.monotonic()
        traffic.stop()
        recovered: dict[str, float | None] = {}
        if traffic.inference is not None:
            recovered = traffic.inference.recovered(args.inference_start_s)
        rows, report = _read_and_check(cluster, traffic)
        orphans = cluster.orphans()
        inference = traffic.inference.summary() if traffic.inference is not None else {}
        ok = _passed(args, report, drained, rows, inference, recovered, orphans)
        summary.update(
            passed=ok,
            all_jobs_finished_in_drain=drained,
            **_job_outcome(traffic, rows, report, steps),
            **_fault_outcome(faults),
            api=traffic.latency_summary(),
            inference=inference,
            inference_recovered_s=recovered,
            orphans=orphans,
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
    parser.add_argument("--workers", type=int, default=3, help="one-device workers")
    parser.add_argument(
        "--two-device-workers", type=int, default=1, help="workers of 2 CPU devices"
    )
    parser.add_argument(
        "--mix",
        choices=sorted(MIXES),
        default="all",
        help="job kinds: all (bench.chaos_jobs) or tiny (the tiny jobs alone, as before)",
    )
    parser.add_argument(
        "--no-inference", action="store_true", help="no inference process nor traffic"
    )
    parser.add_argument(
        "--inference-start-s",
        type=float,
        default=600.0,
        help="how long the base engine may take to start, and to answer after the drain",
    )
    parser.add_argument("--drain-minutes", type=float, default=15.0)
    parser.add_argument("--keep", action="store_true", help="keep the run's folder (logs)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    summary = run(args)
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"chaos_seed{args.seed}_{args.minutes:g}m.json"
    out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(summary_line(args, summary))
    for line in summary.get("violations", [])[:20]:
        print(f"  violation: {line}")
    for failed in summary.get("failed_jobs", [])[:10]:
        print(f"  failed job: {failed}")
    for bad in summary.get("inference", {}).get("bad_answers", [])[:10]:
        print(f"  inference: {bad}")
    for orphan in summary.get("orphans", [])[:10]:
        print(f"  orphan: {orphan}")
    if not summary["passed"]:
        print(f"logs kept in {summary['folder']}")
    print(f"wrote {out}")
    return 0 if summary["passed"] else 1


def summary_line(args: argparse.Namespace, summary: dict[str, Any]) -> str:
    api = summary.get("api", {}).get("window", {})
    inference = summary.get("inference", {}).get("window", {})
    return (
        f"chaos seed {args.seed}, {args.minutes:g} min: "
        f"{'PASSED' if summary['passed'] else 'FAILED'}"
        f"; faults {summary.get('faults_by_kind')} (skipped {summary.get('faults_skipped')})"
        f"; jobs {summary.get('statuses_by_kind')}"
        f"; lost {summary.get('lost')}, duplicated {summary.get('duplicated')}, "
        f"violations {summary.get('violation_count')}, orphans {len(summary.get('orphans', []))}"
        f"; API during faults {api.get('by_status')} {api.get('ok_latency_ms')}"
        f"; inference during faults {inference.get('by_target')} {inference.get('ok_latency_ms')}"
        f", violations {summary.get('inference', {}).get('violations')}"
        f", recovered {summary.get('inference_recovered_s')}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
