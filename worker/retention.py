"""A running job's checkpoint retention, applied by the worker as each checkpoint is recorded.

The rule is the job spec's (``CheckpointSpec.kept_steps``: the newest ``keep_last`` plus the
best by ``keep_best_by``), the same rule the trainer applies to its own folder as a library; in
the service the trainer deletes nothing (``DatabaseCallbacks.applies_retention``) and the worker
does it here, so the records and the disk agree:

1. in the checkpoint's fenced transaction: record the row with its folder's size and the value
   it ranks by (the metric's latest value at or before its step, from the job's metrics), then
   mark every checkpoint the rule no longer keeps as deleted;
2. after that commits: remove those folders (rename to a hidden trash name, then delete).

A crash between the two leaves folders of rows already marked deleted: invisible to the API
(not listed, downloads answer 410), and removed when the job's next attempt starts
(``DatabaseCallbacks.on_start``) or when the job is purged. The newest checkpoint, which a
resume starts from, is always kept.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from sqlalchemy.orm import Session

from app.jobs import checkpoints_repository as checkpoints_repo
from app.progress import repository as progress_repo
from jobspec import CheckpointSpec
from jobspec.checkpoint_files import TRASH_PREFIX, checkpoint_step, job_folder, remove_folder

log = logging.getLogger(__name__)


def _ranked_value(metrics: dict[str, object] | None, name: str | None) -> float | None:
    value = (metrics or {}).get(name) if name is not None else None
    return float(value) if isinstance(value, int | float) else None


def record_checkpoint(
    session: Session,
    *,
    job_id: str,
    step: int,
    attempt: int,
    path: Path,
    size_bytes: int,
    retention: CheckpointSpec | None,
    now: datetime,
) -> list[tuple[int, str]]:
    """Record the checkpoint of `step` and mark the ones `retention` no longer keeps deleted
    (None: keep every one); returns their (step, recorded folder), to remove after commit. The
    live rows read are at most `keep_last` + 2 (the kept ones and the new one)."""
    name = retention.keep_best_by if retention is not None else None
    metrics = None
    if name is not None:
        value = checkpoints_repo.metric_at_or_before(session, job_id=job_id, name=name, step=step)
        metrics = {name: value}
    progress_repo.add_checkpoint_once(
        session,
        job_id=job_id,
        step=step,
        attempt=attempt,
        path=path,
        now=now,
        size_bytes=size_bytes,
        metrics=metrics,
    )
    if retention is None or retention.keep_last is None:
        return []  # every checkpoint is kept: nothing to rank (and no growing list to read)
    rows = progress_repo.checkpoints(session, job_id=job_id)
    kept = retention.kept_steps((row.step, _ranked_value(row.metrics, name)) for row in rows)
    doomed = [(row.step, row.path) for row in rows if row.step not in kept]
    checkpoints_repo.mark_deleted(session, job_id=job_id, steps=[s for s, _ in doomed], now=now)
    return doomed


def remove_folders(checkpoint_dir: Path, job_id: str, paths: Iterable[str]) -> list[Path]:
    """Remove the recorded folders `paths` of the job's deleted checkpoints that still exist;
    returns those removed. Only the job's own ``checkpoint-<step>`` folders in the checkpoint
    store are touched: a recorded path anywhere else (or a link) is left alone and logged."""
    job_dir = job_folder(checkpoint_dir, job_id).resolve()
    removed = []
    for recorded in paths:
        folder = Path(recorded)
        if not folder.is_absolute() or checkpoint_step(folder.name) is None:
            log.warning("job %s: not removing %r: not a checkpoint folder", job_id, recorded)
            continue
        if folder.parent.resolve() != job_dir:
            log.warning("job %s: not removing %r: outside the job's folder", job_id, recorded)
            continue
        try:
            if remove_folder(folder):
                removed.append(folder)
        except OSError as exc:  # the next attempt or the purge tries again
            log.warning("job %s: could not remove %s: %s", job_id, folder.name, exc)
    return removed


def remove_job_folder(checkpoint_dir: Path, job_id: str) -> bool:
    """Remove the job's whole folder of checkpoints (its purge), and any trash an interrupted
    removal of it left; True when the folder was there."""
    root = checkpoint_dir.resolve()
    folder = job_folder(root, job_id)
    if not job_id or job_id in (".", "..") or "/" in job_id or folder.parent != root:
        log.warning("not removing the folder of job %r: not a job id", job_id)
        return False
    removed = remove_folder(folder)
    for leftover in root.glob(f"{TRASH_PREFIX}{job_id}-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return removed
