"""The statuses a job can be in, declared once: the state machine (app.transitions) owns the moves
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


# A worker is on the job (or is stopping it): it holds a dispatch slot of its project.
RUNNING_STATES = (JobStatus.RUNNING, JobStatus.CANCELLING, JobStatus.PAUSING)
# Not finished: what a project's quota of active jobs counts (queued, sent or waiting; running).
ACTIVE_STATES = (JobStatus.QUEUED, *RUNNING_STATES)
