"""The statuses a job can be in, declared once: the state machine (app.transitions) owns the moves
between them; the API's filters, the CLI's choices and the dashboard's list read them from here.
No imports beyond the standard library, so that the CLI can use it without the service stack."""

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
