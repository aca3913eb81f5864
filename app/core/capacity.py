"""What the API answers when a shared capacity of the process is full: a project at its own
share gets 429, everyone else 503, both with Retry-After and a message naming the setting
(grading.fair_slots). One place for every such capacity: python-grader sandboxes, upload
decoding."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from app.core.errors import ApiError, Overloaded, TooManyRequests
from grading.fair_slots import FairSlots, SlotsBusy

__all__ = ["held_slot", "refusal"]


def refusal(exc: SlotsBusy, param: str) -> ApiError:
    """The API error for a refused slot: 429 for the project's own cap, else 503."""
    error = TooManyRequests if exc.per_project else Overloaded
    return error(str(exc), retry_after=exc.retry_after_s, param=param)


@contextlib.contextmanager
def held_slot(slots: FairSlots, project_id: str, *, param: str) -> Iterator[int]:
    """One of ``slots`` for ``project_id`` while the block runs; a refusal (or one raised in
    the block, such as a sandbox the host would not start) becomes :func:`refusal`."""
    try:
        with slots.slot(project_id) as slot:
            yield slot
    except SlotsBusy as exc:
        raise refusal(exc, param) from None
