"""A real Hugging Face hub-cache layout on disk, built from a local model folder, so tests read
Hub models by repo id through huggingface_hub with no hub anywhere:

    <cache>/models--<owner>--<name>/
        blobs/<sha>                      file contents, named by hash
        snapshots/<commit>/<file>        relative symlinks into ../../blobs
        refs/<branch>                    the commit the branch points to (no newline)

As `hf download` leaves it: weights and other large files are named by their sha256 (LFS), the
rest by their git blob sha1.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".model")


def _blob_name(data: bytes, name: str) -> str:
    if name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def add_snapshot(
    cache: Path,
    repo_id: str,
    source: Path,
    commit: str,
    *,
    branches: Iterable[str] = ("main",),
    skip: Iterable[str] = (),
    link: bool = False,
) -> Path:
    """Add `source`'s top-level files as commit `commit` of `repo_id` in the hub cache `cache`,
    with `branches` pointing at it; the snapshot folder. `link` hard-links large blobs (cheap
    for big weights) where the file system allows it."""
    repo = repo_folder(cache, repo_id)
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    skipped = set(skip)
    for file in sorted(source.iterdir()):
        if not file.is_file() or file.name in skipped:
            continue
        data = file.read_bytes()
        blob = blobs / _blob_name(data, file.name)
        if not blob.exists():
            if link and file.stat().st_size > 1 << 20:
                try:
                    os.link(file, blob)
                except OSError:
                    blob.write_bytes(data)
            else:
                blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    for branch in branches:
        ref = repo / "refs" / branch
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    return snapshot
