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

A job may also name a Hugging Face Hub repo id (``owner/name``, syntax checked by the spec, see
:mod:`jobspec.model_source`) when the operator allows Hub models (``GRPO_ALLOW_HUB_MODELS``,
on by default) and, if they listed any, the id matches one of the patterns of
``GRPO_HUB_MODEL_ALLOWLIST`` (:func:`hub_model_refusal`). Whether the worker can read it (its
Hugging Face cache, or the Hub when it is online) is only known on the worker (:mod:`trainer.models.hub`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

from jobspec import PACKAGED_MODELS, text_problem

__all__ = [
    "DATASET_MARKERS",
    "allowed_dataset_folder",
    "allowed_model_folder",
    "dataset_refusal",
    "hub_allowlist",
    "hub_model_refusal",
    "model_refusal",
]


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
    return _allowed_folder(model, roots, forbidden, ("config.json",))


# The files `datasets.save_to_disk` writes: a DatasetDict's, or a single Dataset's.
DATASET_MARKERS = ("dataset_dict.json", "state.json")


def allowed_dataset_folder(
    path: str, roots: Sequence[str | Path], forbidden: Sequence[str | Path] = ()
) -> Path | None:
    """The real folder of a saved ``datasets`` dataset a job may read, else None: the model
    folder rule (module docstring) with the dataset roots, and a folder holding what
    ``save_to_disk`` writes."""
    return _allowed_folder(path, roots, forbidden, DATASET_MARKERS)


def dataset_refusal(*, has_roots: bool) -> str:
    """The one message for every refused dataset path; it names no path."""
    if not has_roots:
        return "this service reads no datasets from disk (no dataset roots are configured)"
    return (
        "must be a folder saved by datasets' save_to_disk under one of this service's dataset roots"
    )


def _allowed_folder(
    path: str, roots: Sequence[str | Path], forbidden: Sequence[str | Path], markers: Sequence[str]
) -> Path | None:
    model = path
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
        return real if any((real / marker).is_file() for marker in markers) else None
    except (OSError, RuntimeError, ValueError):  # missing, unreadable, a symlink loop
        return None


def hub_allowlist(text: str) -> tuple[str, ...]:
    """The patterns of a ``GRPO_HUB_MODEL_ALLOWLIST`` value (separated by commas or spaces)."""
    return tuple(item for item in re.split(r"[\s,]+", text) if item)


def _allowlisted(repo_id: str, pattern: str) -> bool:
    # An owner alone allows all of its models; the Hub treats ids case-insensitively.
    full = pattern if "/" in pattern else f"{pattern}/*"
    return fnmatchcase(repo_id.lower(), full.lower())


def hub_model_refusal(
    repo_id: str, *, allow_hub: bool, allowlist: Sequence[str], has_roots: bool
) -> str | None:
    """Why this service refuses the Hub repo id ``repo_id``, or None when a job may use it.

    ``allowlist`` holds owners (``Qwen``: any of its models) and glob patterns of repo ids
    (``Qwen/Qwen2.5-*``, ``HuggingFaceTB/SmolLM2-135M-Instruct``), matched ignoring case;
    empty allows every repo id."""
    if not allow_hub:
        folders = " or a model folder under one of its model roots" if has_roots else ""
        return (
            "model: this service does not train models from the Hugging Face Hub; use a "
            f"packaged model ({', '.join(PACKAGED_MODELS)}){folders}"
        )
    if allowlist and not any(_allowlisted(repo_id, pattern) for pattern in allowlist):
        return (
            f"model: {repo_id} is not among the Hugging Face Hub models this service allows "
            f"({', '.join(allowlist)})"
        )
    return None
