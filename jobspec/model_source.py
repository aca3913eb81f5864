"""What a job's ``model`` may name, by its text alone: a packaged model, an absolute path to a
model folder, or a Hugging Face Hub repo id (``owner/name``) with an optional revision.

Torch-free and filesystem-free: the spec validates with these rules, the API's admission and the
worker then apply the operator's rules (:mod:`jobspec.paths`).

A Hub repo id follows the Hub's own rules, a little stricter: exactly one ``/`` between an owner
and a name, each of ASCII letters, digits, ``_``, ``-`` and ``.``, starting and ending with a
letter, digit or ``_``; no ``--`` or ``..`` anywhere (``--`` separates the parts of a folder
name in the Hub cache); not ending in ``.git``; at most 96 characters. So a repo id is never a
path: it has no leading ``/``, no ``..`` and no second ``/``.

A revision is a branch, a tag or a 40-hex commit (``main``, ``v1.0``, ``refs/pr/3``): ASCII
letters, digits and ``_ - . /``, at most 128 characters, each ``/``-separated part non-empty and
not starting with ``.`` or ``-``, and not ending in ``.lock``.
"""

from __future__ import annotations

import re

__all__ = [
    "MAX_HUB_REPO_ID_CHARS",
    "MAX_REVISION_CHARS",
    "hub_repo_id_problem",
    "is_hub_repo_id",
    "looks_like_hub_repo_id",
    "revision_problem",
]

MAX_HUB_REPO_ID_CHARS = 96
MAX_REVISION_CHARS = 128

_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")
_REVISION_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def looks_like_hub_repo_id(model: str) -> bool:
    """Whether ``model`` was meant as a repo id (it has a ``/`` but is no absolute path), so a
    refusal can explain the repo id rules rather than list every kind of model."""
    return "/" in model and not model.startswith("/")


def hub_repo_id_problem(model: str) -> str | None:
    """Why ``model`` is not a valid Hub repo id (``owner/name``), or None when it is."""
    if len(model) > MAX_HUB_REPO_ID_CHARS:
        return f"a Hub repo id is at most {MAX_HUB_REPO_ID_CHARS} characters"
    parts = model.split("/")
    if len(parts) != 2:
        return "a Hub repo id is owner/name, with exactly one '/'"
    if ".." in model or "--" in model:
        return "a Hub repo id must not contain '..' or '--'"
    if model.endswith(".git"):
        return "a Hub repo id must not end in '.git'"
    for part in parts:
        if not _PART.fullmatch(part):
            return (
                "the owner and the name of a Hub repo id are ASCII letters, digits, '_', '-' "
                "and '.', starting and ending with a letter, a digit or '_'"
            )
    return None


def is_hub_repo_id(model: str) -> bool:
    """Whether ``model`` is a valid Hub repo id (see :func:`hub_repo_id_problem`)."""
    return hub_repo_id_problem(model) is None


def revision_problem(revision: str) -> str | None:
    """Why ``revision`` is not a valid Hub revision (branch, tag or commit), or None."""
    if not 1 <= len(revision) <= MAX_REVISION_CHARS:
        return f"a revision is 1 to {MAX_REVISION_CHARS} characters"
    if revision.endswith(".lock"):
        return "a revision must not end in '.lock'"
    for part in revision.split("/"):
        if not _REVISION_PART.fullmatch(part) or ".." in part:
            return (
                "a revision (branch, tag or commit) is ASCII letters, digits, '_', '-', '.' and "
                "'/', with no empty part, no part starting with '.' or '-', and no '..'"
            )
    return None
