"""What the trainer's own code says about a model, run in a short-lived subprocess: it imports
torch and transformers (and may build a packaged model), and the control process stays
without them.

- A base model's folder, by the trainer's resolution (``resolve_model``: packaged names built
  once into the model cache, Hub ids in the host's Hugging Face cache, folders under the
  operator's model roots): ``python -m inference.resolve '{"model": ..., "revision": ...,
  "roots": [...], "forbidden": [...]}'`` prints ``{"folder": ...}`` or ``{"error": ...}``. A
  Hub id resolves at ``revision`` (a job's ``model_revision``; None: main), as the worker
  resolved it for training.
- An engine folder's chat-template traits (:func:`chat_traits`), by the trainer's probe of its
  tokenizer (``trainer.agents.chat.chat_format``): ``{"traits_of": folder}`` prints
  ``{"traits": {...}}``, so a chat with tools reaches the engine as the trainer's rollouts
  rendered it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from pydantic import ValidationError

from app.core.settings import Settings
from jobspec import is_hub_repo_id
from jobspec.prompt_format import TemplateTraits

log = logging.getLogger(__name__)


class BaseAt(NamedTuple):
    """A base model at a Hub revision (None: the default, main)."""

    model: str
    revision: str | None


class BaseModelUnavailable(Exception):
    """The base model cannot be served here; the message names no server path."""


def _run(request: Mapping[str, object], timeout_s: float) -> tuple[dict[str, object], str, int]:
    """The subprocess's answer (its last line as JSON; {} when there is none), its stderr and
    its exit code; subprocess.TimeoutExpired past ``timeout_s``."""
    out = subprocess.run(
        [sys.executable, "-m", "inference.resolve", json.dumps({**request, "parent": os.getpid()})],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    lines = out.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    return (answer if isinstance(answer, dict) else {}), out.stderr, out.returncode


def resolve_base(
    model: str, settings: Settings, *, revision: str | None = None, timeout_s: float
) -> Path:
    """The folder of base model ``model`` (at Hub ``revision``) under the service's rules (the
    worker's: model roots, Hub allow-list, never the data folder or the checkpoint store)."""
    if is_hub_repo_id(model):
        refusal = settings.hub_model_refusal(model)
        if refusal is not None:
            raise BaseModelUnavailable(refusal)
    request = {
        "model": model,
        "revision": revision,
        "roots": settings.model_root_list,
        "forbidden": [str(settings.data_dir), str(settings.resolved_checkpoint_dir)],
    }
    try:
        answer, stderr, code = _run(request, timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise BaseModelUnavailable(f"resolving {model} took over {timeout_s:.0f}s") from exc
    if "folder" in answer:
        return Path(str(answer["folder"]))
    why = answer.get("error")
    if not why:  # a crash: its output (which may name server paths) goes to this log only
        log.error("inference: resolving %s failed: %s", model, stderr[-2000:])
        why = f"the resolver failed (exit {code}); the inference log says why"
    at = f" (revision {revision})" if revision else ""
    raise BaseModelUnavailable(f"base model {model}{at}: {why}")


def chat_traits(folder: Path, *, timeout_s: float) -> TemplateTraits | None:
    """How the chat template of the engine folder ``folder`` takes tools, as the trainer probes
    it; None when the probe fails (logged: a chat with tools is then refused, never guessed)."""
    try:
        answer, stderr, code = _run({"traits_of": str(folder)}, timeout_s)
    except subprocess.TimeoutExpired:
        log.error("inference: probing the chat template of %s took over %.0fs", folder, timeout_s)
        return None
    try:
        return TemplateTraits.model_validate(answer["traits"])
    except (KeyError, ValidationError):
        log.error(
            "inference: probing the chat template of %s failed (exit %s): %s",
            folder,
            code,
            answer.get("error") or stderr[-2000:],
        )
        return None


def exit_when_orphaned(parent: int, interval_s: float = 0.5) -> threading.Thread:
    """Ends this process as soon as its parent ``parent`` is gone (the parent pid changes).

    Why not the kernel's parent-death signal: it follows the thread that forked, and the
    inference process runs each resolution from a worker thread that may end first. A
    resolution can build a packaged model for minutes; without this it ran on after its
    inference process stopped (seen for 15 s under ``grpo serve``'s stop)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(3)

    thread = threading.Thread(target=watch, name="orphan-watch", daemon=True)
    thread.start()
    return thread


def _probe_traits(folder: str) -> int:
    from transformers import AutoTokenizer

    from trainer.agents.chat import chat_format

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        probed = chat_format(tokenizer)
    except (OSError, ValueError) as exc:  # no tokenizer there, or no chat template
        print(json.dumps({"error": f"{type(exc).__name__}: {str(exc)[:500]}"}))
        return 1
    traits = TemplateTraits(
        native_tools=probed.native_tools, tool_role=probed.tool_role, family=probed.family
    )
    print(json.dumps({"traits": traits.model_dump()}))
    return 0


def main(argv: list[str]) -> int:
    request = json.loads(argv[0])
    exit_when_orphaned(int(request.get("parent") or os.getppid()))
    if "traits_of" in request:
        return _probe_traits(str(request["traits_of"]))
    from trainer.errors import TrainerError
    from trainer.models.loading import resolve_model

    try:
        folder = resolve_model(
            request["model"],
            revision=request.get("revision"),
            allowed_roots=[Path(root) for root in request["roots"]],
            forbidden=[Path(folder) for folder in request["forbidden"]],
        )
    except (TrainerError, FileNotFoundError, ValueError) as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    print(json.dumps({"folder": str(folder)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
