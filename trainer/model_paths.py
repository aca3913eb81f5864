"""Which model folders a job may read: the one rule the API (at submission) and the worker
(before it loads weights) both apply. Torch-free, so the API can import it.

A job may name a Hugging Face folder only under one of the operator's model roots. Checked in
this order, so nothing outside the roots is ever looked at on disk: an absolute path with no
`..` component, lexically under a root (as configured, or as resolved when a root is itself a
symlink); then, every symlink followed, still under a resolved root and outside `forbidden`
(the service's data folder and checkpoint store, should a root be drawn too broadly: another
project's checkpoints are reachable only through `init_from`, by job and step); then a folder
with a `config.json`. Every refusal has the same message, which names no path, so a tenant
cannot learn which paths exist on the server.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath

from trainer.config import PACKAGED_MODELS, text_problem

__all__ = ["allowed_model_folder", "model_refusal"]


def model_refusal(*, has_roots: bool) -> str:
    """The one message for every refused `model`; it depends on the settings only."""
    packaged = ", ".join(PACKAGED_MODELS)
    if not has_roots:
        return f"model must be one of this service's packaged models: {packaged}"
    return (
        f"model must be a packaged model ({packaged}) or a Hugging Face model folder "
        "(with a config.json) under one of this service's model roots"
    )


def _inside(path: Path, folders: Iterable[Path]) -> bool:
    return any(path.is_relative_to(folder) for folder in folders)


def allowed_model_folder(
    model: str, roots: Sequence[str | Path], forbidden: Sequence[str | Path] = ()
) -> Path | None:
    """The real folder `model` names when a job may train from it, else None (see the module
    docstring for the rule)."""
    if not roots or not model.startswith("/") or text_problem(model) is not None:
        return None
    if ".." in PurePosixPath(model).parts:
        return None
    try:
        written = [Path(os.path.abspath(Path(root).expanduser())) for root in roots]
        real_roots = [Path(root).expanduser().resolve() for root in roots]
        lexical = Path(os.path.normpath(model))
        if not _inside(lexical, [*written, *real_roots]):
            return None
        real = lexical.resolve(strict=True)
        real_forbidden = [Path(folder).resolve() for folder in forbidden]
        if not _inside(real, real_roots) or _inside(real, real_forbidden):
            return None
        return real if (real / "config.json").is_file() else None
    except (OSError, RuntimeError, ValueError):  # missing, unreadable, a symlink loop
        return None
