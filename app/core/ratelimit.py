"""Fair use per API key: a request rate limit (token bucket) and a cap on open event streams.

Both count in Redis when Redis is configured, so every API process shares one count per key, and
in this process's memory otherwise (the embedded default is one API process). Redis is a helper,
not a dependency: when it does not answer, this process counts alone for a short while (a key
may then get up to one budget per API process) instead of refusing every request.

- Requests: a token bucket per key, `burst` tokens deep, refilled at `per_minute / 60` tokens a
  second; a request takes one token. In Redis the bucket is one hash updated by a Lua script
  (atomic, timed by the Redis server's clock, so API processes need no synchronised clocks).
- Streams: at most `per_process` open streams in this process (memory) and `per_key` per key. In
  Redis each open stream holds a lease, a member of the key's sorted set scored by its expiry;
  the stream renews it while open and removes it when it ends, and a lease whose process died
  simply expires, so a crash cannot leak a slot for longer than `STREAM_LEASE_S`.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import redis

from app.core.errors import TooManyRequests
from app.core.settings import Settings

log = logging.getLogger(__name__)

STREAM_LEASE_S = 60.0  # a dead process's stream slot is free again after this
STREAM_RENEW_S = STREAM_LEASE_S / 3  # an open stream renews its lease this often
STREAM_RETRY_AFTER_S = 5  # streams end when their clients leave; there is no better estimate
REDIS_BACKOFF_S = 5.0  # after a Redis failure, count in memory this long before trying again
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

_LEASE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[3] == 'renew' then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
elseif redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then
  return 0
else
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
end
redis.call('PEXPIRE', KEYS[1], ttl)
return 1
"""


def _retry_after(seconds: float) -> int:
    """Retry-After is whole seconds, at least 1 (0 would invite an immediate retry)."""
    return max(1, math.ceil(seconds))


class RedisStore:
    """One Redis client with a breaker: after a failure, callers are told to count in memory
    for `REDIS_BACKOFF_S` instead of waiting on a dead server at every request."""

    def __init__(self, url: str | None) -> None:
        self.client = (
            redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
            if url
            else None
        )
        self._down_until = 0.0

    def usable(self) -> bool:
        return self.client is not None and time.monotonic() >= self._down_until

    def failed(self, exc: Exception) -> None:
        if time.monotonic() >= self._down_until:
            log.warning("Redis unavailable for fair-use counting; counting in memory: %s", exc)
        self._down_until = time.monotonic() + REDIS_BACKOFF_S


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
                retry_after=_retry_after(wait),
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


@dataclass
class StreamSlot:
    """One open stream's place in the counts; `release` is idempotent."""

    key_id: str
    lease: str | None  # member of the key's Redis set, or None when counted in memory
    released: bool = field(default=False)


@dataclass(frozen=True)
class SlotLabels:
    """How a kind of slot is named in refusals and in Redis."""

    what: str = "open event streams"
    counted: str = "open streams"  # the noun after a count: "has 2 open streams"
    owner: str = "this API key"  # what `per_key` counts for
    redis_prefix: str = "grpo:streams"
    advice: str = "close one or retry later"


class StreamSlots:
    """Open event streams: at most `per_process` here and `per_key` per API key. The same
    machinery counts other long requests held per owner (`labels`): the inference gateway's
    requests in flight per project."""

    def __init__(
        self,
        per_key: int,
        per_process: int,
        store: RedisStore,
        lease_s: float = STREAM_LEASE_S,
        labels: SlotLabels | None = None,
    ) -> None:
        self.per_key = per_key
        self.per_process = per_process
        self.labels = labels or SlotLabels()
        self.lease_ms = int(lease_s * 1000)
        self._store = store
        self._script = store.client.register_script(_LEASE_SCRIPT) if store.client else None
        self._lock = threading.Lock()
        self._open = 0
        self._by_key: dict[str, int] = {}  # per-key counts made in memory

    @property
    def open(self) -> int:
        """Streams open in this process."""
        return self._open

    def acquire(self, key_id: str) -> StreamSlot:
        """A slot for a new stream of `key_id`, or TooManyRequests (429) beyond either cap.
        Blocking (a Redis round trip): call it from a worker thread."""
        with self._lock:
            if self._open >= self.per_process:
                raise self._refusal(
                    f"this server has {self.per_process} {self.labels.counted}, its limit"
                )
            self._open += 1
        try:
            lease = self._acquire_for_key(key_id)
        except BaseException:
            with self._lock:
                self._open -= 1
            raise
        return StreamSlot(key_id, lease)

    def renew(self, slot: StreamSlot) -> None:
        """Extend the slot's Redis lease; an open stream calls this every `STREAM_RENEW_S`. A
        lease that lapsed meanwhile (Redis was away) is counted again: the stream is open."""
        if slot.lease is None or slot.released or self._script is None:
            return
        try:
            self._script(
                keys=[self._key(slot.key_id)], args=[slot.lease, self.lease_ms, "renew", 0]
            )
        except (redis.RedisError, OSError) as exc:
            self._store.failed(exc)  # the lease may lapse: that frees a slot, it never leaks one

    def release(self, slot: StreamSlot) -> None:
        with self._lock:
            if slot.released:
                return
            slot.released = True
            self._open -= 1
            if slot.lease is None:
                left = self._by_key.get(slot.key_id, 1) - 1
                if left > 0:
                    self._by_key[slot.key_id] = left
                else:
                    self._by_key.pop(slot.key_id, None)
        if slot.lease is not None and self._store.client is not None:
            try:
                self._store.client.zrem(self._key(slot.key_id), slot.lease)
            except (redis.RedisError, OSError) as exc:
                log.debug("stream lease not removed (it expires): %s", exc)

    def _acquire_for_key(self, key_id: str) -> str | None:
        refused = f"{self.labels.owner} has {self.per_key} {self.labels.counted}, its limit"
        if self._script is not None and self._store.usable():
            lease = secrets.token_hex(8)
            try:
                granted = self._script(
                    keys=[self._key(key_id)], args=[lease, self.lease_ms, "take", self.per_key]
                )
            except (redis.RedisError, OSError) as exc:
                self._store.failed(exc)
            else:
                if not granted:
                    raise self._refusal(refused)
                return lease
        with self._lock:
            if self._by_key.get(key_id, 0) >= self.per_key:
                raise self._refusal(refused)
            self._by_key[key_id] = self._by_key.get(key_id, 0) + 1
        return None

    def _key(self, key_id: str) -> str:
        return f"{self.labels.redis_prefix}:{key_id}"

    def _refusal(self, why: str) -> TooManyRequests:
        return TooManyRequests(
            f"too many {self.labels.what}: {why}; {self.labels.advice}",
            retry_after=STREAM_RETRY_AFTER_S,
        )


# The inference gateway's requests in flight, counted per project (app.inference).
INFERENCE_SLOTS = SlotLabels(
    what="chat and completion requests in flight",
    counted="requests in flight",
    owner="this project",
    redis_prefix="grpo:inference:inflight",
    advice="wait for one to finish (GRPO_INFERENCE_MAX_CONCURRENT_PER_PROJECT)",
)


@dataclass
class Limits:
    """The fair-use counters of one API process."""

    requests: RequestLimiter
    streams: StreamSlots
    # Chat and completions: a request budget of their own per key, and requests in flight per
    # project (keyed by project id).
    inference_requests: RequestLimiter
    inference_slots: StreamSlots


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
    )
