"""What the inference processes state of themselves in their registry rows (table
``inference_servers``, written by each `grpo inference` process every heartbeat; the gateway's
own reads are app.gateway.servers_repository, a domain this one may not import). The jobs
domain reads what a job's checkpoints will meet when served: the largest LoRA rank."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.models import InferenceServer

# The key of a registry row's state (app.gateway.protocol.ServerState) that names the largest
# LoRA rank its engines load (GRPO_INFERENCE_MAX_LORA_RANK).
MAX_LORA_RANK_KEY = "max_lora_rank"


def largest_lora_rank_served(session: Session) -> int | None:
    """The largest LoRA rank any registered inference process serves; None when none says.
    Every row counts, fresh or not: the rank is the operator's setting, which a process that
    restarts keeps, and the rows of processes gone for an hour are deleted
    (worker.maintenance.forget_gone_inference_servers)."""
    ranks = [
        state.get(MAX_LORA_RANK_KEY)
        for state in session.scalars(select(InferenceServer.state))
        if isinstance(state, dict)
    ]
    stated = [int(rank) for rank in ranks if isinstance(rank, int) and rank > 0]
    return max(stated, default=None)
