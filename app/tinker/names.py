"""The ids the SDK relies on and the ``tinker://`` paths of saved checkpoints.

The SDK derives a training model's id itself (``<session_id>:train:<n>``, for a model created
by loading a checkpoint) and uses it instead of our reply, and it puts ids into URL paths
unescaped; paths are ``tinker://<model_id>/<kind>/<name>``, exactly three segments.
"""

from __future__ import annotations

import re
from typing import Literal

from app.tinker.wire import WireError

CheckpointType = Literal["training", "sampler"]
# A path's kind segment and the checkpoint_type the SDK shows for it.
CHECKPOINT_KINDS: dict[str, CheckpointType] = {"weights": "training", "sampler_weights": "sampler"}
# A checkpoint's name (save_state("final")): one path segment, also a folder name on our disk.
CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
# Session ids go into URL paths unescaped and model ids split on ":": no "/", "?", "#" or ":".
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MODEL_ID = re.compile(rf"({SESSION_ID.pattern}):train:(0|[1-9][0-9]{{0,9}})")


def _check_session_id(session_id: str) -> None:
    if not SESSION_ID.fullmatch(session_id):
        raise WireError(f"session id {session_id[:80]!r}: 1-64 of A-Z a-z 0-9 _ -")


def training_model_id(session_id: str, n: int) -> str:
    """The id of a session's n-th training client: the SDK derives it itself (create-via-load)
    and uses it instead of our reply, so it must be exactly this."""
    _check_session_id(session_id)
    return f"{session_id}:train:{n}"


def parse_training_model_id(model_id: str) -> tuple[str, int]:
    """(session_id, n) of a training model id, or WireError."""
    match = _MODEL_ID.fullmatch(model_id)
    if match is None:
        raise WireError(f"model_id {model_id[:80]!r}: not <session_id>:train:<n>")
    return match[1], int(match[2])


def sampler_id(session_id: str, n: int) -> str:
    """The id of a session's n-th sampling session (Tinker's own form)."""
    _check_session_id(session_id)
    return f"{session_id}:sample:{n}"


def tinker_path(model_id: str, kind: str, name: str) -> str:
    """tinker://<model_id>/<kind>/<name>, the path of a saved checkpoint."""
    parse_training_model_id(model_id)
    if kind not in CHECKPOINT_KINDS:
        raise WireError(f"checkpoint kind {kind[:40]!r}: one of {sorted(CHECKPOINT_KINDS)}")
    if not CHECKPOINT_NAME.fullmatch(name):
        raise WireError(
            f"checkpoint name {name[:80]!r}: 1-128 of A-Z a-z 0-9 _ . -, not starting with '.' "
            "or '-' (no '/')"
        )
    return f"tinker://{model_id}/{kind}/{name}"


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """(model_id, kind, name) of a checkpoint path, or WireError: the SDK's grammar
    (exactly three segments) with our kinds, ids and names."""
    if len(path) > 512 or not path.startswith("tinker://"):
        raise WireError(f"path {path[:80]!r}: not a tinker://<model_id>/<kind>/<name> path")
    parts = path.removeprefix("tinker://").split("/")
    if len(parts) != 3:
        raise WireError(f"path {path[:80]!r}: not a tinker://<model_id>/<kind>/<name> path")
    if parts[1] == "external_weights":
        raise WireError(f"path {path[:80]!r}: external weights are not supported")
    model_id, kind, name = parts
    if tinker_path(model_id, kind, name) != path:  # validates each part
        raise WireError(f"path {path[:80]!r}: not in canonical form")
    return model_id, kind, name
