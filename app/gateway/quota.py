"""Per-project fair use of the inference gateway, besides the per-key request rate
(GRPO_INFERENCE_RATE_LIMIT_*, app.sessions.deps.get_inference_principal) and the requests in
flight per project (GRPO_INFERENCE_MAX_CONCURRENT_PER_PROJECT, app.core.ratelimit):

- a daily token quota (GRPO_INFERENCE_DAILY_TOKENS_PER_PROJECT): before a request is forwarded,
  the project's prompt plus completion tokens of the UTC day so far are summed; at or past the
  quota, 429 `insufficient_quota` naming the setting, Retry-After the seconds left in the day.
  Requests already in flight finish and are counted, so the day's use may pass the quota by
  what they generate;
- usage recording: every answered request adds its tokens to the project's row for the model
  name (as the client gave it) and the UTC day (app.gateway.usage_repository).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from app.core.errors import InsufficientQuota
from app.gateway import usage_repository as usage_repo

SETTING = "GRPO_INFERENCE_DAILY_TOKENS_PER_PROJECT"


@dataclass(frozen=True)
class DailyUse:
    day: str
    tokens: int
    limit: int | None  # None: no limit

    @property
    def exhausted(self) -> bool:
        return self.limit is not None and self.tokens >= self.limit


def seconds_to_midnight(now: datetime) -> int:
    """Seconds from `now` (UTC) to the next UTC midnight, at least 1."""
    tomorrow = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return max(1, int((tomorrow - now).total_seconds()))


def use_of(session: Session, *, project_id: str, limit: int, now: datetime) -> DailyUse:
    day = usage_repo.day_of(now)
    tokens = usage_repo.tokens_on(session, project_id=project_id, day=day)
    return DailyUse(day, tokens, limit if limit > 0 else None)


def check_daily_tokens(session: Session, *, project_id: str, limit: int, now: datetime) -> None:
    """InsufficientQuota (429) when the project has used its tokens of the day."""
    use = use_of(session, project_id=project_id, limit=limit, now=now)
    if use.exhausted:
        raise InsufficientQuota(
            f"this project has used {use.tokens} tokens today ({use.day}, UTC), its daily "
            f"quota of {use.limit} ({SETTING}); the quota renews at 00:00 UTC",
            retry_after=seconds_to_midnight(now),
        )


def record(
    session: Session,
    *,
    project_id: str,
    model: str,
    now: datetime,
    prompt_tokens: int,
    completion_tokens: int,
) -> None:
    usage_repo.add(
        session,
        project_id=project_id,
        model=model,
        day=usage_repo.day_of(now),
        requests=1,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )
