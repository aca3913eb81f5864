"""What the inference tier can serve of a job's checkpoints, told in the dry run
(`POST /v1/jobs/validate`) before the job trains for hours: an adapter of a LoRA rank past the
tier's `--max-lora-rank` (GRPO_INFERENCE_MAX_LORA_RANK) trains and checkpoints, but no engine
loads it, so /v1/chat/completions refuses its model. A warning, not a refusal: the checkpoints
are still the job's to download, and the operator may raise the limit."""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.jobs import servers_repository as servers_repo
from jobspec import JobSpec

LORA_RANK_FIELD = "lora.rank"


def lora_rank_warning(session: Session, spec: JobSpec) -> str | None:
    """Why the job's LoRA checkpoints could not be served, or None (a full fine-tune, a rank
    within the limit, or no inference process that states its limit)."""
    if spec.lora is None:
        return None
    limit = servers_repo.largest_lora_rank_served(session)
    if limit is None or spec.lora.rank <= limit:
        return None
    return (
        f"{LORA_RANK_FIELD} {spec.lora.rank} is larger than the {limit} the inference tier serves "
        "(GRPO_INFERENCE_MAX_LORA_RANK): the job trains, but /v1/chat/completions cannot serve "
        f"its checkpoints; use a {LORA_RANK_FIELD} of at most {limit}, or ask the operator to "
        "raise the limit"
    )
