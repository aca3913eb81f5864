"""The ids the SDK relies on and the ``tinker://`` paths of saved checkpoints.

The SDK derives a training model's id itself (``<session_id>:train:<n>``, for a model created
by loading a checkpoint) and uses it instead of our reply, and it puts ids into URL paths
unescaped; paths are ``tinker://<model_id>/<kind>/<name>``, exactly three segments.

A sampler weights save is also a model of the OpenAI face (``/v1/chat/completions``, the
catalogue, the dashboard chat): ``ft:<base model>:<save name>:<model id>`` (the form of a job's
``ft:<model>:<suffix>:<job id>``), or its ``tinker://`` path as Tinker's own OpenAI-compatible
endpoint takes it (:func:`read_sampler_model_name`).
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from app.fine_tuning.names import FINE_TUNED_PREFIX
from app.tinker.wire import WireError
from jobspec.checkpoint_files import TINKER_MODEL_ID, TINKER_SAVE_NAME

CheckpointType = Literal["training", "sampler"]
# A path's kind segment and the checkpoint_type the SDK shows for it.
CHECKPOINT_KINDS: dict[str, CheckpointType] = {"weights": "training", "sampler_weights": "sampler"}
# A checkpoint's name (save_state("final")): one path segment, also a folder name on our disk.
CHECKPOINT_NAME = TINKER_SAVE_NAME
# Session ids go into URL paths unescaped and model ids split on ":": no "/", "?", "#" or ":".
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MODEL_ID = TINKER_MODEL_ID
SAMPLER_KIND = "sampler_weights"
# ft:<base model>:<save name>:<model id>; the model id's own ':' are at fixed places, so the
# name reads unambiguously from its end (a job's ft: name ends in its job id, never in
# ":train:<n>").
_SAMPLER_MODEL = re.compile(
    rf"{re.escape(FINE_TUNED_PREFIX)}(.+):({TINKER_SAVE_NAME.pattern}):({TINKER_MODEL_ID.pattern})"
)


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


def base_sampler_model_id(session_id: str, n: int) -> str:
    """The id of the model behind a session's n-th sampling session over a base model alone
    (``create_sampling_client(base_model=...)``): a model of the server's own, which no SDK call
    names (the SDK holds the sampler's id), so its form is apart from the SDK's training ids."""
    _check_session_id(session_id)
    return f"{session_id}:base:{n}"


def is_base_sampler_model(model_id: str) -> bool:
    """Whether ``model_id`` is the model of a base-model sampling session (no training calls,
    no saves: it samples the base model's own weights)."""
    return ":base:" in model_id


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


class SamplerModelName(NamedTuple):
    model_id: str
    name: str
    base_model: str | None  # as the ft: name writes it; None for a tinker:// path


def sampler_model_name(base_model: str, model_id: str, name: str) -> str:
    """The ``ft:`` name the OpenAI face serves a sampler weights save under."""
    return f"{FINE_TUNED_PREFIX}{base_model}:{name}:{model_id}"


def read_sampler_model_name(text: str) -> SamplerModelName | None:
    """The save a model name points at, when it is a sampler save's ``ft:`` name or its
    ``tinker://<model_id>/sampler_weights/<name>`` path; None for any other name. Whether the
    save exists (in the caller's project, of that base model) is for a lookup to say."""
    if text.startswith("tinker://"):
        try:
            model_id, kind, name = parse_tinker_path(text)
        except WireError:
            return None
        return SamplerModelName(model_id, name, None) if kind == SAMPLER_KIND else None
    match = _SAMPLER_MODEL.fullmatch(text)
    if match is None:
        return None
    return SamplerModelName(match[3], match[2], match[1])
