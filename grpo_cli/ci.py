"""The client commands: `grpo submit`, `grpo jobs list|show|cancel|pause|resume`, `grpo logs`, `grpo metrics`,
`grpo download` (grpo_cli.download).

Each returns an exit code from grpo_cli.ci_args.Exit. Human text goes to stdout, the progress bar
and error messages to stderr; with --json, stdout holds only JSON (one document, or one line per
message for `logs`), errors included.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from grpo_cli import ci_env, gates, render
from grpo_cli.ci_args import WEBHOOK_EVENTS, Exit
from grpo_cli.client import ApiError, Client
from grpo_cli.output import Output
from grpo_cli.waiting import TERMINAL, is_transient, retrying, stream_patiently, wait_for_job


@contextmanager
def _client(args: argparse.Namespace) -> Iterator[Client]:
    url = ci_env.api_url(args.api_url, os.environ)
    key = ci_env.api_key(args.api_key, os.environ)
    with Client(url, key) as client:
        yield client


def run(args: argparse.Namespace) -> int:
    out = Output(getattr(args, "json", False))
    try:
        if args.command == "submit":
            return submit(args, out)
        if args.command == "jobs":
            return jobs(args, out)
        if args.command == "logs":
            return logs(args, out)
        if args.command == "download":
            from grpo_cli.download import download  # tqdm: loaded only for a download

            with _client(args) as client:
                return download(args, out, client)
        if args.command == "chat":
            from grpo_cli.chat import chat

            with _client(args) as client:
                return chat(args, out, client)
        return metrics(args, out)
    except ci_env.UsageError as exc:
        return out.error(str(exc), Exit.USAGE)
    except ApiError as exc:
        if is_transient(exc):
            return out.error(f"the API is unavailable: {exc}", Exit.UNAVAILABLE)
        param = f" (param {exc.param})" if exc.param else ""
        return out.error(f"the API refused the request: {exc}{param}", Exit.USAGE)
    except BrokenPipeError:
        # stdout was closed early (`grpo jobs list | head`): stop quietly, with the exit status
        # of a process ended by SIGPIPE, as other command-line tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    except (httpx.TransportError, ConnectionError) as exc:
        url = ci_env.api_url(args.api_url, os.environ)
        return out.error(f"cannot reach the API at {url}: {exc}", Exit.UNAVAILABLE)


# --- submit ---------------------------------------------------------------------------------


def _submit(
    client: Client, spec: dict[str, Any], key: str | None, retry_for: float
) -> tuple[dict[str, Any], bool]:
    """POST the spec. With a key, a transient failure is retried (the server answers a resent
    POST with the job it already created); without one a resend could start a second job."""
    if key is None:
        return client.submit_job(spec, None)
    job, replayed = retrying(retry_for, lambda: client.submit_job(spec, key))
    if replayed:
        # A replay answers with the body stored at creation (status queued): read the job now.
        job_id = job["id"]
        job = retrying(retry_for, lambda: client.get_job(job_id))
    return job, replayed


def _webhook(client: Client, url: str, retry_for: float, out: Output) -> dict[str, Any]:
    """The project's endpoint at `url`, created first if needed (before the job, so its
    every event is sent)."""
    endpoint, created = retrying(
        retry_for, lambda: client.ensure_webhook(url, list(WEBHOOK_EVENTS))
    )
    if created:
        out.text(f"created webhook {endpoint['id']} for {url}")
        out.text(f"its signing secret, shown only now: {endpoint['secret']}")
    else:
        out.text(f"webhook {endpoint['id']} already sends this project's job events to {url}")
    return {**endpoint, "created": created}


def dry_run(client: Client, spec: dict[str, Any], out: Output) -> int:
    """`submit --dry-run`: the validation's warnings and memory plan; exit 0 when the plan fits
    (or none could be made), USAGE when it does not."""
    answer = client.validate_job(spec)
    plan = answer.get("plan")
    for warning in answer.get("warnings", []):
        out.text(f"warning: {warning}")
    out.text(
        render.plan_table(plan) if plan else f"no memory plan: {answer.get('plan_unavailable')}"
    )
    code = Exit.OK if plan is None or plan["fits"] else Exit.USAGE
    if out.json:
        out.doc({**answer, "exit_code": int(code)})
    return int(code)


def submit(args: argparse.Namespace, out: Output) -> int:
    started = time.monotonic()
    spec, folder = ci_env.load_spec(args.spec)
    if args.dry_run:
        with _client(args) as client:
            return dry_run(client, spec, out)
    key: str | None = None
    if not args.no_idempotency_key:
        key = args.idempotency_key or ci_env.idempotency_key(
            spec, ci_env.ci_commit(os.environ, folder)
        )
    wait = bool(args.wait or args.timeout is not None or args.require)
    with _client(args) as client:
        result: dict[str, Any] = {}
        if args.webhook is not None:
            result["webhook"] = _webhook(client, args.webhook, args.retry_for, out)
        job, replayed = _submit(client, spec, key, args.retry_for)
        result |= {"idempotency_key": key, "replayed": replayed}
        if replayed:
            out.text(f"job {job['id']} already exists for this idempotency key ({job['status']})")
        else:
            total = job["progress"]["total_steps"]
            out.text(
                f"submitted job {job['id']} ({job.get('name') or job['model']}, {total} steps)"
            )
        if not wait:
            return _finish(out, result, job, "submitted", Exit.OK)
        deadline = None if args.timeout is None else started + args.timeout
        waited = wait_for_job(
            client,
            job,
            deadline=deadline,
            poll_s=args.poll_interval,
            show_progress=not args.no_progress,
            outage_grace_s=args.retry_for,
        )
        job = waited.job
        if waited.timed_out:
            note = "it keeps running"
            if args.cancel_on_timeout:
                job_id = job["id"]
                job = retrying(args.retry_for, lambda: client.cancel_job(job_id))
                note = f"cancel requested ({job['status']})"
            out.text(
                f"timed out after {gates.format_duration(args.timeout)} waiting for job "
                f"{job['id']} (step {job['progress']['step']}/{job['progress']['total_steps']}, "
                f"{job['status']}); {note}"
            )
            return _finish(out, result, job, "timed_out", Exit.TIMED_OUT)
        progress = job["progress"]
        out.text(
            f"job {job['id']} {job['status']} after {progress['step']}/{progress['total_steps']} "
            f"steps ({gates.format_duration(time.monotonic() - started)})"
        )
        if job["status"] != "succeeded":
            if job.get("error"):
                out.text(f"error: {job['error']['code']}: {job['error'].get('message') or ''}")
            return _finish(out, result, job, job["status"], Exit.JOB_FAILED)
        if not args.require:
            return _finish(out, result, job, "succeeded", Exit.OK)
        names = sorted({r.metric for r in args.require})
        series = retrying(args.retry_for, lambda: client.metrics(job["id"], names=names))["series"]
        verdicts = gates.check(args.require, gates.final_values(series))
        result["requirements"] = [v.as_dict() for v in verdicts]
        ok = all(v.passed for v in verdicts)
        out.text("requirements:" if ok else "requirements (not met):")
        for line in render.verdict_lines(verdicts):
            out.text(line)
        if ok:
            return _finish(out, result, job, "succeeded", Exit.OK)
        return _finish(out, result, job, "requirement_not_met", Exit.REQUIREMENT_NOT_MET)


def _finish(
    out: Output, result: dict[str, Any], job: dict[str, Any], outcome: str, code: Exit
) -> int:
    if out.json:
        out.doc({"job": job, "outcome": outcome, "exit_code": int(code), **result})
    return int(code)


# --- jobs -----------------------------------------------------------------------------------


def jobs(args: argparse.Namespace, out: Output) -> int:
    if args.jobs_command == "list" and not 1 <= args.limit <= 100:
        raise ci_env.UsageError("--limit must be between 1 and 100")
    with _client(args) as client:
        if args.jobs_command == "list":
            page = retrying(
                args.retry_for,
                lambda: client.list_jobs(args.status or None, limit=args.limit, after=args.after),
            )
            if out.json:
                out.doc(page)
            else:
                out.text(render.job_table(page["data"]))
                if page["has_more"]:
                    out.text(f"(more: --after {page['next_after']})")
            return Exit.OK
        if args.jobs_command == "show":
            job = retrying(args.retry_for, lambda: client.get_job(args.job_id))
        elif args.jobs_command == "resume" and args.settings:
            changes = dict(args.settings)  # idempotent too: a repeat finds them applied
            job = retrying(args.retry_for, lambda: client.resume_job(args.job_id, changes))
        else:  # cancel, pause, resume: idempotent, so safe to retry
            job = retrying(
                args.retry_for, lambda: client.control_job(args.job_id, args.jobs_command)
            )
    if out.json:
        out.doc(job)
    elif args.jobs_command == "show":
        out.text(render.job_detail(job))
    else:
        out.text(f"job {job['id']}: {job['status']}")
    return Exit.OK


# --- logs -----------------------------------------------------------------------------------


def _cursor(message_id: str | None) -> tuple[int, int]:
    """A stream message id is `<last event id>.<last step>`."""
    if not message_id:
        return (0, 0)
    event_id, _, step = message_id.partition(".")
    return (int(event_id), int(step or 0))


def _so_far(client: Client, job_id: str, retry_for: float) -> tuple[int, int]:
    """The stream position of everything recorded now: (last event id, last metric step)."""
    events = retrying(retry_for, lambda: client.all_events(job_id))
    # One bucket per series: its step is the series' last step.
    series = retrying(retry_for, lambda: client.metrics(job_id, max_points=1))["series"]
    last_event = max((int(e["id"]) for e in events), default=0)
    last_step = max((int(p["step"]) for points in series.values() for p in points), default=0)
    return last_event, last_step


def logs(args: argparse.Namespace, out: Output) -> int:
    with _client(args) as client:
        job = retrying(args.retry_for, lambda: client.get_job(args.job_id))
        total = int(job["progress"]["total_steps"])
        # Without --follow, read the stream only up to what exists now; a finished job's stream
        # ends by itself.
        target = (
            None
            if args.follow or job["status"] in TERMINAL
            else _so_far(client, job["id"], args.retry_for)
        )
        if target == (0, 0):
            return Exit.OK
        end_status: str | None = None
        for message in stream_patiently(client, job["id"], grace_s=args.retry_for):
            if out.json:
                line = {"event": message.event, "id": message.id, "data": message.data}
                print(json.dumps(line, separators=(",", ":")), flush=True)
            else:
                out.text(render.stream_line(message.event, message.data, total))
            if message.event == "end":
                end_status = str(message.data.get("status"))
                break
            if target is not None and message.id is not None:
                event_id, step = _cursor(message.id)
                if event_id >= target[0] and step >= target[1]:
                    break
    if not args.follow or end_status == "succeeded":
        return Exit.OK
    return Exit.JOB_FAILED


# --- metrics --------------------------------------------------------------------------------


def metrics(args: argparse.Namespace, out: Output) -> int:
    if args.max_points is not None and not 1 <= args.max_points <= 10_000:
        raise ci_env.UsageError("--max-points must be between 1 and 10000")
    with _client(args) as client:
        body = retrying(
            args.retry_for,
            lambda: client.metrics(
                args.job_id, names=args.names or None, max_points=args.max_points
            ),
        )
    if out.json:
        out.doc(body)
    elif args.csv:
        sys.stdout.write(render.metrics_csv(body["series"]))
        sys.stdout.flush()
    else:
        out.text(render.metrics_table(body["series"]))
    return Exit.OK
