"""The per-project checkpoint storage quota, `GRPO_MAX_CHECKPOINT_BYTES_PER_PROJECT`.

What counts: every checkpoint the project stores, from the size recorded when it was saved
(`app.jobs.checkpoints_repository.stored_bytes`, one query): its jobs' kept checkpoints, and a
deleted job's until the workers purge it (`GRPO_DELETE_GRACE_SECONDS`): its folder is on disk
until then, so deleting jobs and starting new ones cannot grow the disk past the limit.
Checkpoints the job's retention deleted do not count (their folders go right after). The
project's Tinker saves count too (`app.tinker.repository.saved_bytes`), expired and deleted ones
until a worker removes them: a Tinker save that would go beyond the limit is refused before it
is written in place (`room_for`, worker.tinker_saves).

Where: as a worker records a checkpoint (`worker.progress.DatabaseCallbacks.on_checkpoint`),
in the checkpoint's own transaction, after the job's retention marked the older checkpoints the
new one replaces (so `keep_last: 1` needs room for one checkpoint, not two) and under the
project's storage lock (two jobs of a project saving at once are counted one after the other).
Over the limit, that transaction is rolled back: the new checkpoint is not kept, and the older
ones retention would have dropped stay. The worker then fails the job
(`checkpoint_quota_exceeded`) with an error event naming the setting, the use and the limit:
training on without saving would end in a job that looks finished but whose latest weights
are gone.

`GET /v1/usage` reports the same numbers (`use_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from app.jobs import checkpoints_repository as checkpoints_repo
from app.tinker import repository as tinker_repo

SETTING = "GRPO_MAX_CHECKPOINT_BYTES_PER_PROJECT"
ERROR_CODE = "checkpoint_quota_exceeded"


@dataclass(frozen=True)
class StorageUse:
    used_bytes: int  # every checkpoint the project stores, deleted jobs' included
    pending_purge_bytes: int  # of those, the deleted jobs' (gone at their purge)
    limit_bytes: int | None  # None: no limit

    @property
    def over(self) -> bool:
        return self.limit_bytes is not None and self.used_bytes > self.limit_bytes


def use_of(session: Session, *, project_id: str, limit: int) -> StorageUse:
    """The project's checkpoint storage against `limit` (0: no limit)."""
    used, pending = checkpoints_repo.stored_bytes(session, project_id=project_id)
    used += tinker_repo.saved_bytes(session, project_id=project_id)
    return StorageUse(used, pending, limit if limit > 0 else None)


def room_for(
    session: Session, *, project_id: str, limit: int, adding: int, freeing: int
) -> StorageUse | None:
    """Before a Tinker save is put in place: the project's use with it (``adding`` bytes, the
    save it replaces ``freeing``) when that is over ``limit``, else None. Holds the project's
    storage lock until the transaction ends."""
    if limit <= 0:
        return None
    checkpoints_repo.lock_storage(session, project_id=project_id)
    now = use_of(session, project_id=project_id, limit=limit)
    use = StorageUse(now.used_bytes + adding - freeing, now.pending_purge_bytes, now.limit_bytes)
    return use if use.over else None


def check_recorded(session: Session, *, project_id: str, limit: int) -> StorageUse | None:
    """Called in the transaction that has just recorded a checkpoint (and marked what the job's
    retention drops): the project's use with it when that is over `limit`, else None (always
    None with no limit). Holds the project's storage lock until the transaction ends."""
    if limit <= 0:
        return None
    checkpoints_repo.lock_storage(session, project_id=project_id)
    use = use_of(session, project_id=project_id, limit=limit)
    return use if use.over else None


def human_bytes(n: int) -> str:
    """`n` bytes in binary units, for messages: 512 B, 3.0 KiB, 1.25 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def refusal_message(
    *, step: int, size: int, would_use: StorageUse, stored: StorageUse, last_kept: int | None
) -> str:
    """What the job's event and error say when the checkpoint of `step` was not kept."""
    assert would_use.limit_bytes is not None
    pending = (
        f", {human_bytes(stored.pending_purge_bytes)} of them deleted jobs' awaiting their purge"
        if stored.pending_purge_bytes
        else ""
    )
    resume = (
        f"The job's latest kept checkpoint is step {last_kept}: after freeing space, a new job "
        f'with "init_from": {{"job_id": ..., "step": {last_kept}}} continues from it.'
        if last_kept is not None
        else "The job has no kept checkpoint."
    )
    return (
        f"checkpoint of step {step} ({human_bytes(size)}) not kept: with it the project's "
        f"checkpoints would take {human_bytes(would_use.used_bytes)}, over its limit of "
        f"{human_bytes(would_use.limit_bytes)} ({SETTING}); the project stores "
        f"{human_bytes(stored.used_bytes)} now{pending}. Training stopped; steps after the "
        f"latest kept checkpoint are lost. Delete jobs whose checkpoints you no longer need "
        f"(they count until purged) or keep fewer checkpoints per job (checkpoint.keep_last). "
        f"{resume}"
    )
