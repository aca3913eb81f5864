"""Fair use per API key: a request rate limit (a token bucket), and the process's set of
counters (:class:`Limits`: requests, open event streams, inference requests and work in flight,
the last three leases of :mod:`app.core.leases`).

The bucket counts in Redis when Redis is configured, so every API process shares one count per
key, and in this process's memory otherwise (the embedded default is one API process). Redis is a
helper, not a dependency: when it does not answer, this process counts alone for a short while
(a key may then get up to one budget per API process) instead of refusing every request. A key's
bucket is `burst` tokens deep, refilled at `per_minute / 60` tokens a second; a request takes
one token. In Redis the bucket is one hash updated by a Lua script (atomic, timed by the Redis
server's clock, so API processes need no synchronised clocks).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import redis

from app.core.errors import TooManyRequests
from app.core.leases import INFERENCE_SLOTS, RedisStore, StreamSlots, WorkBudget, retry_after_s
from app.core.settings import Settings

log = logging.getLogger(__name__)

MAX_TRACKED_KEYS = 100_000  # memory bound of the in-process buckets (least recently used go)

_BUCKET_SCRIPT = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""


class RequestLimiter:
    """Token bucket per API key; `check` raises TooManyRequests (429, Retry-After) when empty.
    Budgets kept apart have their own `redis_prefix`; `name` says in a refusal which one it is."""

    def __init__(
        self,
        per_minute: int,
        burst: int,
        store: RedisStore,
        *,
        name: str = "requests",
        redis_prefix: str = "grpo:ratelimit",
    ) -> None:
        self.rate = per_minute / 60.0  # tokens per second
        self.burst = float(burst)
        self.name = name
        self._prefix = redis_prefix
        self._store = store
        self._script = store.client.register_script(_BUCKET_SCRIPT) if store.client else None
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def check(self, key_id: str) -> None:
        wait = self._take(key_id)
        if wait > 0:
            raise TooManyRequests(
                f"rate limit of {self.rate * 60:g} {self.name} per minute "
                f"(burst {self.burst:g}) for this API key exceeded; retry after the wait",
                retry_after=retry_after_s(wait),
            )

    def _take(self, key_id: str) -> float:
        """Take one token; 0 when there was one, else the seconds until there is."""
        if self._script is not None and self._store.usable():
            try:
                wait = self._script(keys=[f"{self._prefix}:{key_id}"], args=[self.rate, self.burst])
                return float(wait.decode() if isinstance(wait, bytes) else wait)
            except (redis.RedisError, OSError, ValueError) as exc:
                self._store.failed(exc)
        return self._take_in_memory(key_id)

    def _take_in_memory(self, key_id: str) -> float:
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.pop(key_id, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            wait = 0.0
            if tokens >= 1:
                tokens -= 1
            else:
                wait = (1 - tokens) / self.rate
            self._buckets[key_id] = (tokens, now)  # most recently used last
            while len(self._buckets) > MAX_TRACKED_KEYS:
                self._buckets.popitem(last=False)  # an evicted key starts again with a full bucket
        return wait


# KEYS[1]: an owner's leases scored by expiry (ms); KEYS[2]: lease -> its amount. ARGV: lease,
# ttl (ms), 'take' or 'renew', amount, budget. Answers -1 when granted (or renewed), else the
# amount the owner holds. A lease whose process died expires with its amount.


@dataclass
class Limits:
    """The fair-use counters of one API process."""

    requests: RequestLimiter
    streams: StreamSlots
    # Chat and completions: a request budget of their own per key, and requests in flight per
    # project (keyed by project id).
    inference_requests: RequestLimiter
    inference_slots: StreamSlots
    # ... and the tokens of work those requests ask for, per project.
    inference_work: WorkBudget


def build_limits(settings: Settings) -> Limits:
    store = RedisStore(settings.resolved_redis_url)
    return Limits(
        requests=RequestLimiter(settings.rate_limit_per_minute, settings.rate_limit_burst, store),
        streams=StreamSlots(settings.max_streams_per_key, settings.max_streams_per_process, store),
        inference_requests=RequestLimiter(
            settings.inference_rate_limit_per_minute,
            settings.inference_rate_limit_burst,
            store,
            name="chat and completion requests",
            redis_prefix="grpo:ratelimit:inference",
        ),
        inference_slots=StreamSlots(
            settings.inference_max_concurrent_per_project,
            settings.inference_max_concurrent_per_process,
            store,
            labels=INFERENCE_SLOTS,
        ),
        inference_work=WorkBudget(
            settings.inference_max_tokens_in_flight_per_project,
            store,
            setting="GRPO_INFERENCE_MAX_TOKENS_IN_FLIGHT_PER_PROJECT",
        ),
    )
