"""The Tinker API's share of the workers' maintenance (worker.maintenance runs it every pass):

- models waiting for a worker whose message is old are sent again: a worker deferred them for
  a job, or refused them for their project's worker bound, or the broker lost the message;
- released models (idle, written to disk) whose session ended are closed and their idle
  folders removed, as are the idle folders of models that ended otherwise;
- stored calls are bounded (app.tinker.storage): results read a minute ago or never read
  within the retention are dropped, and the call rows of sessions ended longer ago than the
  retention are deleted.

Every step is a short unit of work of its own and safe to run on several workers at once.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from app.core.clock import utcnow
from app.core.db import session_scope
from app.tinker import repository as repo
from app.tinker import upkeep_repository as up
from app.tinker import worker_repository as q
from app.tinker.dispatch import send_model
from worker.context import WorkerContext
from worker.tinker_idle import remove_idle_state

log = logging.getLogger(__name__)

# A waiting model's message older than this is sent again.
RESEND_AFTER_S = 15.0
# Rows one pass handles at most per step.
BATCH = 100


def tinker_upkeep(ctx: WorkerContext) -> None:
    requeue_released_with_calls(ctx)
    resend_waiting_models(ctx)
    close_released_of_ended_sessions(ctx)
    remove_idle_states_of_ended_models(ctx)
    bound_stored_calls(ctx)


def resend_waiting_models(ctx: WorkerContext) -> list[str]:
    """Send again the models waiting for a worker whose last message is old; their ids."""
    now = utcnow()
    with session_scope(ctx.sessions) as db:
        due = q.models_to_send(db, sent_before=now - timedelta(seconds=RESEND_AFTER_S), limit=BATCH)
    sent = []
    for model_id in due:
        if not send_model(ctx.settings, model_id):
            break  # the broker is down: the next pass tries again
        with session_scope(ctx.sessions) as db:
            q.mark_sent(db, model_id=model_id, now=utcnow())
        sent.append(model_id)
    return sent


def requeue_released_with_calls(ctx: WorkerContext) -> list[str]:
    """Released models with calls waiting go back to the queue. A call requeues its released
    model as it is accepted (app.tinker.service.accept_request, fenced against the release);
    this only repairs a row left otherwise (a database restored from a backup, say)."""
    with session_scope(ctx.sessions) as db:
        return up.requeue_released_with_calls(db, now=utcnow(), limit=BATCH)


def _ended_before(ctx: WorkerContext, now: datetime) -> datetime:
    return repo.stale_since(now, ctx.settings.tinker_session_ttl_s)


def close_released_of_ended_sessions(ctx: WorkerContext) -> list[str]:
    """Close the released models whose session is over (finished, or silent past its TTL):
    nothing will call them again. Their idle folders go too."""
    now = utcnow()
    with session_scope(ctx.sessions) as db:
        rows = up.released_of_ended_sessions(db, ended_before=_ended_before(ctx, now), limit=BATCH)
        closed = [(m, folder) for m, folder in rows if up.close_released(db, model_id=m)]
    for _, folder in closed:
        remove_idle_state(folder)
    return [model_id for model_id, _ in closed]


def remove_idle_states_of_ended_models(ctx: WorkerContext) -> int:
    """The idle folders of models that ended (closed or failed) while one was recorded."""
    with session_scope(ctx.sessions) as db:
        rows = up.idle_states_of_ended(db, limit=BATCH)
        for model_id, _ in rows:
            up.forget_idle_state(db, model_id=model_id)
    for _, folder in rows:
        remove_idle_state(folder)
    return len(rows)


def bound_stored_calls(ctx: WorkerContext) -> tuple[int, int]:
    """Drop old results and delete the call rows of long-ended sessions; (results dropped,
    rows deleted)."""
    now = utcnow()
    retention = ctx.settings.tinker_result_retention_s
    with session_scope(ctx.sessions) as db:
        dropped = up.drop_results(db, now=now, retention_s=retention)
    ended_before = _ended_before(ctx, now) - timedelta(seconds=retention)
    deleted = 0
    with session_scope(ctx.sessions) as db:
        sessions = up.ended_sessions(db, ended_before=ended_before, limit=BATCH)
    for session_id in sessions:
        with session_scope(ctx.sessions) as db:
            deleted += up.delete_calls_of_session(db, session_id=session_id)
    if dropped or deleted:
        log.info("tinker upkeep: %d results dropped, %d call rows deleted", dropped, deleted)
    return dropped, deleted
