"""Amounts held against budgets that every API process shares: open event streams per key and
per process, and the inference gateway's requests and work in flight per project.

Each holder takes a lease (:class:`OwnerLeases`): in Redis when configured, a member of its
owner's sorted set scored by its expiry, with its amount beside it (one Lua script, so API
processes share the sums); in this process's memory otherwise, or while Redis is away
(:class:`RedisStore`'s breaker). The holder renews its lease while it holds it and removes it
when done, and a lease whose process died simply expires, so a crash cannot leak a slot for
longer than `STREAM_LEASE_S`. Streams hold leases of 1 (:class:`StreamSlots`); the gateway's work
holds its request's amount (:class:`WorkBudget`).
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass, field

import redis

from app.core.errors import TooManyRequests

log = logging.getLogger(__name__)

STREAM_LEASE_S = 60.0  # a dead process's stream slot is free again after this
STREAM_RENEW_S = STREAM_LEASE_S / 3  # an open stream renews its lease this often
STREAM_RETRY_AFTER_S = 5  # streams end when their clients leave; there is no better estimate
REDIS_BACKOFF_S = 5.0  # after a Redis failure, count in memory this long before trying again


def retry_after_s(seconds: float) -> int:
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


_LEASE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
for _, lease in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('HDEL', KEYS[2], lease)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[3] == 'take' then
  local held = 0
  for _, value in ipairs(redis.call('HVALS', KEYS[2])) do held = held + tonumber(value) end
  if held > 0 and held + tonumber(ARGV[4]) > tonumber(ARGV[5]) then return held end
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return -1
"""


@dataclass
class Lease:
    """One holder's share of its owner's budget; released once."""

    owner: str
    amount: int
    token: str
    in_redis: bool  # False: counted in this process's memory
    released: bool = field(default=False)


class OwnerLeases:
    """Amounts held per owner, summed against a budget: a lease is granted while the sum stays
    within it, and always when the owner holds nothing. In Redis when configured (one Lua
    script, so API processes share the sums), in memory otherwise or while Redis is away.
    Holders renew their leases; a lease not renewed within `lease_s` expires."""

    def __init__(self, store: RedisStore, redis_prefix: str, lease_s: float) -> None:
        self.lease_ms = int(lease_s * 1000)
        self._store = store
        self._prefix = redis_prefix
        self._script = store.client.register_script(_LEASE_SCRIPT) if store.client else None
        self._lock = threading.Lock()
        self._held: dict[str, dict[str, int]] = {}  # owner -> token -> amount, in memory

    def take(self, owner: str, amount: int, budget: int) -> Lease | int:
        """A lease, or (refused) the amount the owner holds. Blocking: a Redis round trip."""
        lease = Lease(owner, amount, secrets.token_hex(8), in_redis=False)
        if self._script is not None and self._store.usable():
            try:
                held = self._call(lease, "take", budget)
            except (redis.RedisError, OSError, ValueError) as exc:
                self._store.failed(exc)
            else:
                lease.in_redis = held < 0
                return lease if held < 0 else held
        with self._lock:
            mine = self._held.setdefault(owner, {})
            held = sum(mine.values())
            if held > 0 and held + amount > budget:
                return held
            mine[lease.token] = amount
        return lease

    def renew(self, lease: Lease) -> None:
        """Extend a Redis lease (one that lapsed while Redis was away is counted again)."""
        if lease.in_redis and not lease.released and self._script is not None:
            try:
                self._call(lease, "renew", 0)
            except (redis.RedisError, OSError) as exc:
                self._store.failed(exc)  # the lease may lapse: that frees, it never leaks

    def release(self, lease: Lease) -> bool:
        """False when it was released already."""
        with self._lock:
            if lease.released:
                return False
            lease.released = True
            mine = self._held.get(lease.owner, {})
            mine.pop(lease.token, None)
            if not mine:
                self._held.pop(lease.owner, None)
        if lease.in_redis and self._store.client is not None:
            key = self._key(lease.owner)
            try:
                self._store.client.zrem(key, lease.token)
                self._store.client.hdel(f"{key}:amounts", lease.token)
            except (redis.RedisError, OSError) as exc:
                log.debug("lease not removed (it expires): %s", exc)
        return True

    def _call(self, lease: Lease, op: str, budget: int) -> int:
        assert self._script is not None
        key = self._key(lease.owner)
        args: list[str | int] = [lease.token, self.lease_ms, op, lease.amount, budget]
        return int(self._script(keys=[key, f"{key}:amounts"], args=args))

    def _key(self, owner: str) -> str:
        return f"{self._prefix}:{owner}"


StreamSlot = Lease  # an open stream's lease (amount 1) on its key's slots


@dataclass(frozen=True)
class SlotLabels:
    """How a kind of slot is named in refusals and in Redis."""

    what: str = "open event streams"
    counted: str = "open streams"  # the noun after a count: "has 2 open streams"
    owner: str = "this API key"  # what `per_key` counts for
    redis_prefix: str = "grpo:streams"
    advice: str = "close one or retry later"


class StreamSlots:
    """Open event streams: at most `per_process` here and `per_key` per API key (leases of
    amount 1). The same machinery counts other long requests held per owner (`labels`): the
    inference gateway's requests in flight per project."""

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
        self._leases = OwnerLeases(store, self.labels.redis_prefix, lease_s)
        self._lock = threading.Lock()
        self._open = 0

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
            granted = self._leases.take(key_id, 1, self.per_key)
        except BaseException:
            granted = 0
            raise
        finally:
            if not isinstance(granted, Lease):  # refused or failed: not open here either
                with self._lock:
                    self._open -= 1
        if isinstance(granted, Lease):
            return granted
        raise self._refusal(
            f"{self.labels.owner} has {self.per_key} {self.labels.counted}, its limit"
        )

    def renew(self, slot: StreamSlot) -> None:
        """Extend the slot's lease; an open stream calls this every `STREAM_RENEW_S`."""
        self._leases.renew(slot)

    def release(self, slot: StreamSlot) -> None:
        if self._leases.release(slot):
            with self._lock:
                self._open -= 1

    def _refusal(self, why: str) -> TooManyRequests:
        return TooManyRequests(
            f"too many {self.labels.what}: {why}; {self.labels.advice}",
            retry_after=STREAM_RETRY_AFTER_S,
        )


class WorkBudget:
    """The work (tokens) an owner's requests in flight may ask for together (`budget`): a
    request is admitted while the sum stays within it, and always when the owner has nothing
    in flight, so one request larger than the budget still runs, alone."""

    def __init__(
        self, budget: int, store: RedisStore, *, setting: str, lease_s: float = STREAM_LEASE_S
    ) -> None:
        self.budget = budget
        self.setting = setting  # named in a refusal
        self._leases = OwnerLeases(store, "grpo:inference:work", lease_s)

    def acquire(self, owner: str, work: int) -> Lease:
        """A lease of `work`, or TooManyRequests (429). Blocking: call it from a thread."""
        granted = self._leases.take(owner, max(0, work), self.budget)
        if isinstance(granted, Lease):
            return granted
        raise TooManyRequests(
            f"this project's requests in flight ask for {granted} tokens of work; this one "
            f"adds {work}, past its budget of {self.budget} ({self.setting}); retry when one "
            "finishes",
            retry_after=STREAM_RETRY_AFTER_S,
        )

    def renew(self, lease: Lease) -> None:
        self._leases.renew(lease)

    def release(self, lease: Lease) -> None:
        self._leases.release(lease)


# The inference gateway's requests in flight, counted per project (app.gateway).
INFERENCE_SLOTS = SlotLabels(
    what="chat and completion requests in flight",
    counted="requests in flight",
    owner="this project",
    redis_prefix="grpo:inference:inflight",
    advice="wait for one to finish (GRPO_INFERENCE_MAX_CONCURRENT_PER_PROJECT)",
)
