"""The names the OpenAI face gives a job's weights, declared once.

A job's fine-tuned model is `ft:<model as requested>:<suffix>:<job id>` (the suffix may be
empty) and a checkpoint's `ft:...:<job id>:ckpt-step-<step>`, stable for the job's life. The
fine-tuning API shows them (app.fine_tuning.presenters), the model catalogue lists them and
resolves them back to a job and a step (app.gateway.service), and `grpo download` reads them
(grpo_cli.download, which imports no service package and keeps its own reader).

No imports beyond the job row and the id helpers, so any layer may use them."""

from __future__ import annotations

from typing import NamedTuple

from app.core.ids import MAX_STEP, parse_number
from app.core.models import Job

FINE_TUNED_PREFIX = "ft:"
CHECKPOINT_SUFFIX = "ckpt-step-"


def base_model(job: Job) -> str:
    """The model the job was asked to train, as the client wrote it (an OpenAI name the
    operator maps, or the native `model`)."""
    requested = (job.openai or {}).get("model")
    return str(requested or job.spec.get("model", ""))


def fine_tuned_model_name(job: Job) -> str:
    suffix = (job.openai or {}).get("suffix") or ""
    return f"{FINE_TUNED_PREFIX}{base_model(job)}:{suffix}:{job.id}"


def checkpoint_model_name(job: Job, step: int) -> str:
    return f"{fine_tuned_model_name(job)}:{CHECKPOINT_SUFFIX}{step}"


class NamedWeights(NamedTuple):
    job_id: str
    step: int | None  # None: the job's final weights


def read_fine_tuned_name(name: str) -> NamedWeights | None:
    """The job id and checkpoint step an `ft:` name points at, read from its end (the model
    part may itself hold ':'), or None when `name` cannot be such a name. Whether it is one is
    for a lookup to say: the caller compares `name` with the job's own name, so
    `ft:<anything>:<job id>` never passes for the job's."""
    if not name.startswith(FINE_TUNED_PREFIX):
        return None
    head, _, last = name.rpartition(":")
    step = None
    if last.startswith(CHECKPOINT_SUFFIX):
        step = parse_number(last.removeprefix(CHECKPOINT_SUFFIX), MAX_STEP)
        if step is None:
            return None
        head, _, last = head.rpartition(":")
    if not last or len(head) <= len(FINE_TUNED_PREFIX):
        return None
    return NamedWeights(last, step)
