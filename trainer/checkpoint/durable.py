"""Folders written so that a crash leaves them complete or absent: everything fsynced, then
renamed into place (:func:`write_atomically`); what checkpoints, Tinker saves and exports
share."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["fsync_dir", "fsync_tree", "write_atomically"]


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a directory: its entries (a rename into it) become durable."""
    # Directory fsync makes the entries (the rename) durable; not every platform allows it.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root``."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            _fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def write_atomically(out: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write`` on a fresh temporary sibling folder of ``out``, fsync what it wrote, then
    rename it to ``out``: ``out`` is complete or absent, even across a crash.
    FileExistsError when ``out`` exists (nothing is ever overwritten)."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        fsync_tree(tmp)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
