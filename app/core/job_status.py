"""The statuses a job can be in, declared once: the state machine (app.jobs.transitions) owns the moves
between them, the API's filters use them.
No imports beyond the standard library. The CLI keeps its own copy (grpo_cli/ci_args.py, checked
equal by a test) because it imports no service package at all."""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PAUSING = "pausing"
    PAUSED = "paused"


# Ordered tuples: SQL filters write them out in this order (the partial index's predicate
# among them, app.core.models.is_active).
#
# A worker is on the job (or is stopping it): it holds the job's lease, so its writes are
# fenced by the attempt (app.jobs.transitions), and a dispatch slot of its project.
LEASE_HOLDING_STATES = (JobStatus.RUNNING, JobStatus.CANCELLING, JobStatus.PAUSING)
# What a project's quota of active jobs counts: queued (sent or waiting) or lease-holding;
# not paused, not finished.
QUOTA_COUNTED_STATES = (JobStatus.QUEUED, *LEASE_HOLDING_STATES)
