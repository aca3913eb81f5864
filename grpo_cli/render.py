"""Human-readable text for the client commands: job tables, log lines, metric tables and CSV.
Pure functions from API bodies to strings."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_cli.gates import Verdict

# Shown on each step's log line when present, in this order; `grpo metrics` has all of them.
STEP_METRICS = ("reward/mean", "reward/std", "kl", "loss/policy", "entropy", "time/step")


def number(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-" if value is None else str(value)
    return f"{value:.4g}"


def _short_time(iso: str | None) -> str:
    """`2026-01-02T03:04:05.678+00:00` -> `03:04:05`."""
    if not iso:
        return "-"
    return iso[11:19] if len(iso) >= 19 else iso


def job_line(job: Mapping[str, Any]) -> str:
    progress = job["progress"]
    return (
        f"{job['id']:<32} {job['status']:<10} {progress['step']:>5}/{progress['total_steps']:<5} "
        f"{(job.get('name') or '-')[:28]:<28} {str(job['created_at'])[:19]}"
    )


def job_table(jobs: Sequence[Mapping[str, Any]]) -> str:
    header = f"{'ID':<32} {'STATUS':<10} {'STEP':>11} {'NAME':<28} CREATED"
    return "\n".join([header, *(job_line(j) for j in jobs)])


def job_detail(job: Mapping[str, Any]) -> str:
    progress = job["progress"]
    lines = [
        f"job       {job['id']}",
        f"name      {job.get('name') or '-'}",
        f"status    {job['status']}",
        f"model     {job['model']}",
        f"step      {progress['step']}/{progress['total_steps']}",
        f"attempt   {job['attempt']}/{job['max_attempts']}",
        f"created   {job['created_at']}",
        f"started   {job.get('started_at') or '-'}",
        f"finished  {job.get('finished_at') or '-'}",
    ]
    if progress.get("eta_s") is not None:
        lines.append(f"eta       {progress['eta_s']:.0f}s")
    if job.get("error"):
        lines.append(f"error     {job['error']['code']}: {job['error'].get('message') or ''}")
    for key, value in (job.get("metadata") or {}).items():
        lines.append(f"metadata  {key}={value}")
    last = progress.get("last_metrics") or {}
    if last:
        lines.append("last metrics:")
        lines += [f"  {name:<36} {number(value)}" for name, value in sorted(last.items())]
    return "\n".join(lines)


def step_line(data: Mapping[str, Any], total_steps: int | None = None) -> str:
    """One stream `metrics` message: `step   3/10  reward/mean 0.5  kl 0.0012 ...`."""
    values: Mapping[str, float | None] = data.get("values") or {}
    shown = [n for n in STEP_METRICS if n in values]
    shown += sorted(n for n in values if n.startswith("eval/"))
    total = f"/{total_steps}" if total_steps else ""
    parts = [f"{name} {number(values[name])}" for name in shown]
    return f"step {data['step']:>4}{total}  " + "  ".join(parts)


def stream_line(event: str, data: Mapping[str, Any], total_steps: int | None = None) -> str:
    if event == "metrics":
        return step_line(data, total_steps)
    if event == "end":
        return f"end: job {data.get('status')}"
    level = data.get("level", "info")
    tag = data.get("type", event) if level == "info" else f"{data.get('type', event)} {level}"
    return f"{_short_time(data.get('created_at'))} [{tag}] {data.get('message', '')}"


def metric_rows(series: Mapping[str, Sequence[Mapping[str, Any]]]) -> tuple[list[str], list[Any]]:
    """Series -> (metric names, rows of [step, value per name or None]), steps ascending."""
    names = sorted(series)
    by_step: dict[int, dict[str, float]] = {}
    for name in names:
        for point in series[name]:
            by_step.setdefault(int(point["step"]), {})[name] = float(point["value"])
    rows = [[step, *(by_step[step].get(n) for n in names)] for step in sorted(by_step)]
    return names, rows


def metrics_csv(series: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """CSV: header `step,<metric>,...`; one row per step; an empty cell where a metric was not
    recorded at that step (eval/* metrics exist only at evaluation steps). Values are written
    with repr(), so they round-trip exactly."""
    names, rows = metric_rows(series)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["step", *names])
    for step, *values in rows:
        writer.writerow([step, *("" if v is None else repr(v) for v in values)])
    return out.getvalue()


def metrics_table(series: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """Steps down, metrics across, for people (use --csv for tools)."""
    names, rows = metric_rows(series)
    if not rows:
        return "no metrics recorded yet"
    header = ["step", *names]
    cells = [[str(step), *(number(v) for v in values)] for step, *values in rows]
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in [header, *cells]
    )


def verdict_lines(verdicts: Sequence[Verdict]) -> list[str]:
    out = []
    for verdict in verdicts:
        req = verdict.requirement
        if verdict.final is None:
            out.append(f"  FAIL  {req}: {req.metric} was never recorded")
        else:
            mark = "ok  " if verdict.passed else "FAIL"
            out.append(
                f"  {mark}  {req}: {req.metric} = {number(verdict.final.value)} "
                f"(step {verdict.final.step})"
            )
    return out


def _gib(size: int) -> str:
    return f"{size / 2**30:9.2f} GiB"


def plan_table(plan: Mapping[str, Any]) -> str:
    """A memory plan (POST /v1/jobs/validate's `plan`) as a small table, per device."""
    parts = plan["per_device"]
    lines = [f"memory plan per device ({plan['devices']} device(s))"]
    if "micro_batch_size" in plan:
        chosen = " (auto: the largest that fits)" if plan.get("micro_batch_auto") else ""
        lines.append(f"  {'micro-batch':<12} {plan['micro_batch_size']:>9} completions{chosen}")
    lines += [f"  {name:<12} {_gib(size)}" for name, size in parts.items() if name != "kv_cache"]
    if parts.get("kv_cache"):
        lines.insert(-1, f"  {'  (KV cache)':<12} {_gib(parts['kv_cache'])}")
    lines.append(f"  {'total':<12} {_gib(plan['total'])}")
    lines.append(f"  {'device':<12} {_gib(plan['device_memory'])}  (usable {_gib(plan['usable'])})")
    lines.append("fits" if plan["fits"] else "does NOT fit")
    for suggestion in plan.get("suggestions", []):
        change = ", ".join(f"{k}: {v}" for k, v in suggestion["change"].items())
        lines.append(f"  would fit: {change:<28} total {_gib(suggestion['total'])}")
    return "\n".join(lines)
