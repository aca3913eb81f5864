"""Where checkpoints live and what their folders are called, the file names of a checkpoint folder
that are the trainer's own resume state, and deleting and measuring checkpoint folders:
torch-free, declared once for the trainer, the workers, the API and the inference tier.

A job's checkpoints are ``<checkpoint store>/<job id>/checkpoint-<step:06d>``
(:func:`job_folder`, :func:`checkpoint_folder_name`); what users see of a stored checkpoint is
its folder's name (:func:`folder_name`), never the server path. A Tinker training client's saves
are ``<checkpoint store>/tinker/<project>/<model id>/<kind>/<name>`` (:func:`tinker_save_folder`:
the worker writes them there, the inference tier serves sampler weights from there; a job id
starts with ``job_``, so no job's folder is ``tinker``).

A checkpoint folder (``trainer.checkpoint.store``) holds a loadable model (or LoRA adapters) and
tokenizer, plus these files, which only the trainer reads back. Everything that hands a
checkpoint's model to someone else leaves them out: ``grpo export`` (``trainer.checkpoint.export``) and the
API's checkpoint download (``app.progress.checkpoint_download``), which must not import torch.

Deleting a checkpoint (or a job's whole folder) goes through :func:`remove_folder` here too, in
the trainer's own pruning and in the service's retention and purge alike: the folder is first
renamed to a hidden ``.trash-`` name, so a crash mid-delete never leaves a partial folder that
still looks like a checkpoint (``trainer.checkpoint.store.sweep_temp_dirs`` removes leftovers).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import uuid
from pathlib import Path, PurePath

__all__ = [
    "CHECKPOINT_PREFIX",
    "MANIFEST",
    "OPTIMIZER_FILE",
    "PROJECT_ID",
    "RNG_FILE",
    "SHARDED_DIR",
    "TINKER_DIR",
    "TINKER_MODEL_ID",
    "TINKER_SAVE_NAME",
    "TRAINER_FILES",
    "TRASH_PREFIX",
    "checkpoint_folder",
    "checkpoint_folder_name",
    "checkpoint_step",
    "folder_bytes",
    "folder_name",
    "is_model_file",
    "job_folder",
    "remove_folder",
    "tinker_idle_folder",
    "tinker_project_folder",
    "tinker_save_folder",
]

CHECKPOINT_PREFIX = "checkpoint-"
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d{6,})$")

MANIFEST = "manifest.json"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng_state.pt"
# A multi-rank run's weights and optimizer state, one file per rank (trainer.checkpoint.sharded).
SHARDED_DIR = "sharded"
TRAINER_FILES = frozenset({MANIFEST, OPTIMIZER_FILE, RNG_FILE, SHARDED_DIR})
TRASH_PREFIX = ".trash-"


def checkpoint_folder_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``: ``checkpoint-<step:06d>``."""
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def checkpoint_step(name: str) -> int | None:
    """The step a checkpoint folder's name holds; None for any other name (temporary and trash
    folders included)."""
    match = _CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def job_folder(store: Path, job_id: str) -> Path:
    """Where the job's checkpoints live in the checkpoint store (the worker's output folder)."""
    return Path(store) / job_id


# A Tinker training client's id (``<session id>:train:<n>``, the form the SDK derives itself)
# and a save's name (one path segment): declared here, where the folders they name are laid out.
TINKER_MODEL_ID = re.compile(r"([A-Za-z0-9_-]{1,64}):train:(0|[1-9][0-9]{0,9})")
TINKER_SAVE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
TINKER_DIR = "tinker"
# A project id as it may name a folder (app.core.ids makes them `proj_<hex>`).
PROJECT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def tinker_project_folder(store: Path, project_id: str) -> Path:
    """Where a project's Tinker saves live in the checkpoint store (ValueError for an id that
    is not one: nothing path-like reaches the disk)."""
    if not PROJECT_ID.fullmatch(project_id):
        raise ValueError(f"not a project id: {project_id[:80]!r}")
    return Path(store) / TINKER_DIR / project_id


def tinker_save_folder(store: Path, project_id: str, model_id: str, kind: str, name: str) -> Path:
    """The folder of a Tinker client's save: ``kind`` ``weights`` (the state) or
    ``sampler_weights`` (the adapters). ValueError for a part that is not a valid one."""
    if not TINKER_MODEL_ID.fullmatch(model_id) or not TINKER_SAVE_NAME.fullmatch(name):
        raise ValueError(f"not a Tinker save: {model_id[:80]!r} {name[:80]!r}")
    if kind not in ("weights", "sampler_weights"):
        raise ValueError(f"not a Tinker save kind: {kind[:40]!r}")
    # ':' is not a portable file-name character.
    return tinker_project_folder(store, project_id) / model_id.replace(":", "_") / kind / name


def tinker_idle_folder(store: Path, project_id: str, model_id: str, version: str) -> Path:
    """The folder an idle Tinker client is written to when its worker is released (a version
    per release, hex): the client's own folder's ``idle/`` part, beside its saves' kinds."""
    if not TINKER_MODEL_ID.fullmatch(model_id) or not re.fullmatch(r"[0-9a-f]{1,64}", version):
        raise ValueError(f"not an idle state: {model_id[:80]!r} {version[:80]!r}")
    return tinker_project_folder(store, project_id) / model_id.replace(":", "_") / "idle" / version


def checkpoint_folder(store: Path, job_id: str, step: int) -> Path:
    """The folder of the job's checkpoint of ``step`` in the checkpoint store."""
    return job_folder(store, job_id) / checkpoint_folder_name(step)


def folder_name(stored_path: str) -> str:
    """The name of a stored checkpoint's folder (what users see; the stored path, written by a
    worker, may use either separator and tells a tenant about the server)."""
    return PurePath(stored_path.replace("\\", "/").rstrip("/")).name


def is_model_file(name: str) -> bool:
    """Whether a file (or folder) at the top of a checkpoint folder belongs to the model export
    (not resume state)."""
    return name not in TRAINER_FILES


def remove_folder(path: Path) -> bool:
    """Delete the folder ``path``: rename it to a hidden trash name beside it, then remove that.
    False when there was nothing to delete (already gone, or not a real folder: a link is left
    alone). A crash (or an error) after the rename leaves only the trash folder."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return False
    trash = path.parent / f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:  # another process deleted it first
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def folder_bytes(path: Path) -> int:
    """The total size in bytes of the regular files under the folder ``path`` (links are not
    followed or counted); 0 when ``path`` is not a real folder."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return 0
    total = 0
    for current, _dirs, files in os.walk(path, followlinks=False):
        for name in files:
            try:
                info = os.lstat(os.path.join(current, name))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    return total
