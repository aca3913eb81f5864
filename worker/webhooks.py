"""Webhook delivery: the workers send the outbox rows (app.webhooks.outbox) to their endpoints.

One delivery at a time: claim it (a short transaction that makes it due again only after the
attempt's timeout, so a worker that dies mid-send leaves it to another), POST it with the
Standard Webhooks headers, then record the attempt and move the delivery on: delivered on a
2xx, else due again after an exponential backoff with full jitter, or failed once its retry
window (a day by default) has passed. Redirects are never followed. Unless the operator allows
private addresses, the host is looked up again before every attempt and the connection goes to
the address that was checked (DNS rebinding cannot move it onto a private one).

Every worker process runs a WebhookThread (so does the embedded `grpo serve`, whose worker is a
`grpo worker` process); claims are compare-and-sets, so concurrent workers never double-send
inside one lease."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import httpx
from sqlalchemy.exc import SQLAlchemyError

from app.core.clock import as_utc, utcnow
from app.core.db import session_scope
from app.webhooks import repository as webhooks_repo
from app.webhooks.protocol import encode, sign
from app.webhooks.urls import UrlRefused, check, public_address
from worker.context import WorkerContext

log = logging.getLogger(__name__)

# Most deliveries one pass sends; the rest wait for the next pass.
PASS_LIMIT = 100
# Seconds added to the attempt's timeout before a claimed delivery is due again.
LEASE_MARGIN_S = 30.0
MAX_ERROR_CHARS = 500
# Old finished deliveries are deleted this often, at most PRUNE_BATCH at a time.
PRUNE_EVERY_S = 600.0
PRUNE_BATCH = 1000
USER_AGENT = "grpo-service-webhooks/1"

Jitter = Callable[[float], float]


def full_jitter(ceiling: float) -> float:
    """A delay drawn uniformly from [0, ceiling] ("full jitter")."""
    return random.uniform(0.0, ceiling)


def retry_delay(attempt: int, *, base: float, cap: float, jitter: Jitter = full_jitter) -> float:
    """Seconds before the try after failed try number `attempt` (1-based): full jitter over
    min(cap, base * 2^(attempt - 1))."""
    ceiling = min(cap, base * 2.0 ** min(attempt - 1, 62))
    return max(0.0, jitter(ceiling))


def _post(
    client: httpx.Client, claimed: webhooks_repo.Claimed, *, allow_private: bool
) -> tuple[int | None, str | None]:
    """Send once; (status code, None) when the receiver answered, else (None, why not)."""
    body = encode(claimed.payload)
    timestamp = int(time.time())
    headers = {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "webhook-id": claimed.id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(
            claimed.secret, msg_id=claimed.id, timestamp=timestamp, body=body
        ),
    }
    try:
        target = check(claimed.url, allow_private=True)
        url = httpx.URL(claimed.url)
        extensions: dict[str, str] = {}
        if not allow_private:
            # Connect to the address just checked, not to whatever a second lookup returns;
            # the Host header and TLS (SNI and certificate name) keep the URL's host name.
            address = public_address(target)
            headers["host"] = url.netloc.decode("ascii")
            if target.scheme == "https":
                extensions["sni_hostname"] = target.host
            url = url.copy_with(host=str(address))
        with client.stream(
            "POST", url, content=body.encode(), headers=headers, extensions=extensions
        ) as response:
            return response.status_code, None  # the body is never read
    except UrlRefused as exc:
        return None, f"refused: url {exc}"
    except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]


def deliver_one(ctx: WorkerContext, client: httpx.Client, *, jitter: Jitter = full_jitter) -> bool:
    """Claim the delivery due longest, send it and record the attempt; False if none was due."""
    settings = ctx.settings
    now = utcnow()
    lease = timedelta(seconds=settings.webhook_timeout_seconds * 2 + LEASE_MARGIN_S)
    with session_scope(ctx.sessions) as session:
        claimed = webhooks_repo.claim_due(session, now=now, lease_until=now + lease)
    if claimed is None:
        return False
    started = utcnow()
    clock = time.monotonic()
    status_code, error = _post(client, claimed, allow_private=settings.webhook_allow_private)
    duration_ms = int((time.monotonic() - clock) * 1000)
    finished = utcnow()
    next_attempt_at = None
    if status_code is not None and 200 <= status_code < 300:
        state = webhooks_repo.DELIVERED
    else:
        if error is None:
            error = f"HTTP {status_code}"
        delay = retry_delay(
            claimed.attempt,
            base=settings.webhook_retry_base_seconds,
            cap=settings.webhook_retry_max_delay_seconds,
            jitter=jitter,
        )
        give_up_at = (as_utc(claimed.queued_at) or finished) + timedelta(
            hours=settings.webhook_retry_window_hours
        )
        if finished + timedelta(seconds=delay) > give_up_at:
            state = webhooks_repo.FAILED
        else:
            state = webhooks_repo.PENDING
            next_attempt_at = finished + timedelta(seconds=delay)
    with session_scope(ctx.sessions) as session:
        recorded = webhooks_repo.record_attempt(
            session,
            claimed=claimed,
            started_at=started,
            duration_ms=duration_ms,
            status_code=status_code,
            error=error,
            state=state,
            next_attempt_at=next_attempt_at,
        )
    log.info(
        "webhook %s attempt %d: %s (%d ms)%s",
        claimed.id,
        claimed.attempt,
        status_code if status_code is not None else error,
        duration_ms,
        "" if recorded else " (not recorded: the delivery was taken over or deleted)",
    )
    return True


def make_client(ctx: WorkerContext) -> httpx.Client:
    """Short timeouts, no redirects, no proxies or netrc from the environment."""
    timeout = ctx.settings.webhook_timeout_seconds
    return httpx.Client(
        timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
        follow_redirects=False,
        trust_env=False,
    )


def deliver_due(
    ctx: WorkerContext,
    client: httpx.Client,
    *,
    limit: int = PASS_LIMIT,
    jitter: Jitter = full_jitter,
    stop: threading.Event | None = None,
) -> int:
    """Send deliveries while some are due (at most `limit`); returns how many were tried."""
    sent = 0
    while sent < limit and not (stop is not None and stop.is_set()):
        if not deliver_one(ctx, client, jitter=jitter):
            break
        sent += 1
    return sent


def prune(ctx: WorkerContext) -> int:
    """Delete finished deliveries past the retention period (a bounded batch per call)."""
    cutoff = utcnow() - timedelta(days=ctx.settings.webhook_retention_days)
    with session_scope(ctx.sessions) as session:
        return webhooks_repo.prune_finished(session, before=cutoff, limit=PRUNE_BATCH)


class WebhookThread:
    """Delivers due webhooks every `webhook_poll_seconds`, and prunes old ones every
    PRUNE_EVERY_S, until stopped."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="grpo-webhooks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        pruned_at = 0.0
        with make_client(self._ctx) as client:
            while not self._stop.wait(self._ctx.settings.webhook_poll_seconds):
                try:
                    deliver_due(self._ctx, client, stop=self._stop)
                    if time.monotonic() - pruned_at >= PRUNE_EVERY_S:
                        pruned_at = time.monotonic()
                        prune(self._ctx)
                except SQLAlchemyError as exc:
                    log.warning("webhook delivery skipped: database unavailable (%s)", exc)
                except Exception:  # never let the thread die
                    log.exception("webhook delivery failed")
