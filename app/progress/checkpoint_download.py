"""A job's checkpoint as a tar archive, streamed (`GET /v1/jobs/{id}/checkpoints/{step}/download`).

The archive holds the checkpoint's model: a Hugging Face model folder, or for a LoRA job the
adapter folder (`adapter_config.json`, `adapter_model.safetensors`) and the tokenizer, under one
top folder `<job_id>-step<step>/`. The trainer's resume state (optimizer, RNG states, manifest:
`jobspec.checkpoint_files`) is left out.

It is never built in memory or on disk: `locate` checks the folder and lists its files (with the
caller's session), then `CheckpointArchive.chunks` writes each member's tar header, the file's
bytes in chunks and the padding to a 512-byte block, then the two zero blocks that end a tar; so
the exact length is known before the first byte (Content-Length), and streaming needs no session.

The stored path is not trusted: it must resolve to `<checkpoint dir>/<job id>/checkpoint-<step>`
exactly (so no link, `..` or edited row leads elsewhere), and a file in it that is a link
leading out of the folder refuses the download. No error names a path on the server.
"""

from __future__ import annotations

import logging
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path

from sqlalchemy.orm import Session

from app.core.errors import Gone, NotFound
from app.progress import repository as progress_repo
from jobspec.checkpoint_files import checkpoint_folder, is_model_file

log = logging.getLogger(__name__)

BLOCK = 512
CHUNK = 1024 * 1024
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class Member:
    name: str  # the name in the archive, under the top folder
    path: Path
    size: int


@dataclass(frozen=True)
class CheckpointArchive:
    top: str  # the archive's top folder: <job_id>-step<step>
    members: tuple[Member, ...]
    mtime: int

    @property
    def filename(self) -> str:
        return f"{self.top}.tar"

    def _info(self, name: str, size: int, *, folder: bool = False) -> bytes:
        info = tarfile.TarInfo(name)
        info.size = 0 if folder else size
        info.type = tarfile.DIRTYPE if folder else tarfile.REGTYPE
        info.mode = 0o755 if folder else 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = self.mtime
        # PAX: names of any length and members over 8 GiB (a large model's shard).
        return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")

    @property
    def size(self) -> int:
        """The archive's exact length in bytes."""
        total = len(self._info(f"{self.top}/", 0, folder=True)) + 2 * BLOCK
        for member in self.members:
            total += len(self._info(member.name, member.size)) + _padded(member.size)
        return total

    def chunks(self) -> Iterator[bytes]:
        """The archive, a header or up to CHUNK bytes of a file at a time. A file that changed
        size since `locate` (the checkpoint was deleted while streaming) ends the stream with an
        error rather than a malformed archive: the client sees a short body."""
        yield self._info(f"{self.top}/", 0, folder=True)
        for member in self.members:
            yield self._info(member.name, member.size)
            left = member.size
            with open(member.path, "rb") as handle:
                while left > 0:
                    data = handle.read(min(CHUNK, left))
                    if not data:
                        raise OSError(f"checkpoint file {member.name} shrank while streaming")
                    left -= len(data)
                    yield data
            if member.size % BLOCK:
                yield bytes(BLOCK - member.size % BLOCK)
        yield bytes(2 * BLOCK)


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def safe_name(text: str) -> str:
    return _SAFE.sub("_", text) or "checkpoint"


def locate(session: Session, *, checkpoint_dir: Path, job_id: str, step: int) -> CheckpointArchive:
    """The archive of `job_id`'s checkpoint at `step` (the caller checked the job is theirs).

    404 (param `step`) when the job has no checkpoint at that step or its recorded folder is not
    that job's folder in the checkpoint store; 410 when the checkpoint was deleted (by the job's
    retention: the row says so; or its folder is gone)."""
    row = progress_repo.checkpoint_at(session, job_id=job_id, step=step)
    if row is None:
        raise NotFound(f"job {job_id} has no checkpoint at step {step}", param="step")
    gone = Gone(
        f"the checkpoint of step {step} was deleted (the job's checkpoint retention keeps its "
        "latest checkpoints and the best one: see GET /v1/jobs/{id}/checkpoints)",
        param="step",
    )
    if row.deleted_at is not None:
        raise gone
    root = checkpoint_dir.resolve()
    expected = checkpoint_folder(root, job_id, step)
    stored = Path(row.path)
    refused = NotFound(
        f"the checkpoint of step {step} is not in this service's checkpoint store", param="step"
    )
    if not stored.is_absolute() or os.sep in job_id or job_id in ("", ".", ".."):
        log.warning("checkpoint %s/%s: refused stored path %r", job_id, step, row.path)
        raise refused
    folder = stored.resolve()
    if folder != expected:
        log.warning("checkpoint %s/%s: %r is not %s", job_id, step, row.path, expected)
        raise refused
    top = f"{safe_name(job_id)}-step{step}"
    try:
        members = tuple(_members(folder, top, job_id, step)) if folder.is_dir() else ()
    except FileNotFoundError:  # deleted while we listed it
        raise gone from None
    if not members:
        raise gone
    created = row.created_at if row.created_at.tzinfo else row.created_at.replace(tzinfo=UTC)
    return CheckpointArchive(top=top, members=members, mtime=int(created.timestamp()))


def _members(folder: Path, top: str, job_id: str, step: int) -> Iterator[Member]:
    """The model files of `folder`, sorted, subfolders included; the trainer's files left out."""
    for current, dirs, files in os.walk(folder, followlinks=False):
        here = Path(current)
        # A multi-rank run's sharded optimizer state is resume state, not the model.
        dirs[:] = sorted(d for d in dirs if here != folder or is_model_file(d))
        for name in sorted(files):
            path = here / name
            relative = path.relative_to(folder).as_posix()
            if here == folder and not is_model_file(name):
                continue
            real = path.resolve()
            if not real.is_relative_to(folder) or not real.is_file():
                log.warning("checkpoint %s/%s: %s links out of its folder", job_id, step, relative)
                raise NotFound(
                    f"the checkpoint of step {step} holds a link that leaves its folder; "
                    "it cannot be downloaded",
                    param="step",
                )
            yield Member(f"{top}/{relative}", real, real.stat().st_size)
