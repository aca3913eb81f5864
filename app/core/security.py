"""API keys: `grpo_<prefix>_<secret>`. The prefix finds the row, the secret is compared against a
SHA-256 digest in constant time. Secrets are 256-bit random, so a fast hash is enough (no
password-stretching needed) and the plaintext never touches the database or the logs."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

KEY_PREFIX = "grpo"


@dataclass(frozen=True)
class GeneratedKey:
    prefix: str
    secret_hash: str
    plaintext: str


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def generate_key() -> GeneratedKey:
    prefix = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return GeneratedKey(prefix, _digest(secret), f"{KEY_PREFIX}_{prefix}_{secret}")


def split_key(plaintext: str) -> tuple[str, str] | None:
    """Return (prefix, secret) of a well-formed key, else None."""
    parts = plaintext.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


def secret_matches(secret: str, secret_hash: str) -> bool:
    return hmac.compare_digest(_digest(secret), secret_hash)


class VerifiedKeys(Generic[T]):
    """Keys this process verified in the last `ttl_s` seconds, so a client polling a job does
    not cost a database lookup per request. Keyed by the SHA-256 of the whole presented key
    (prefix and secret), never by the key itself; only successes are kept, so wrong keys cannot
    fill it. At most `max_entries` (least recently used go first).

    Each entry carries the `epoch` it was verified under (the shared revocation counter,
    app.sessions.revocations, read before the lookup): `get` with another epoch is a miss, so
    a revocation anywhere makes every entry stale at once. A key revoked in the database
    without a bump of that counter keeps working for up to `ttl_s` seconds."""

    def __init__(
        self, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        # fingerprint -> (expiry by the clock, epoch, value)
        self._entries: OrderedDict[bytes, tuple[float, int, T]] = OrderedDict()
        self._lock = threading.Lock()  # the API's sync routes run in a threadpool

    @staticmethod
    def _fingerprint(presented: str) -> bytes:
        return hashlib.sha256(presented.encode()).digest()

    def get(self, presented: str, epoch: int = 0) -> T | None:
        if self.ttl_s <= 0:
            return None
        fingerprint = self._fingerprint(presented)
        with self._lock:
            entry = self._entries.get(fingerprint)
            if entry is None:
                return None
            if entry[0] <= self._clock() or entry[1] != epoch:
                del self._entries[fingerprint]
                return None
            self._entries.move_to_end(fingerprint)
            return entry[2]

    def put(self, presented: str, value: T, epoch: int = 0) -> None:
        if self.ttl_s <= 0:
            return
        fingerprint = self._fingerprint(presented)
        with self._lock:
            self._entries[fingerprint] = (self._clock() + self.ttl_s, epoch, value)
            self._entries.move_to_end(fingerprint)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def forget(self, presented: str) -> None:
        """Drop the entry of `presented`, so its next use is looked up again."""
        with self._lock:
            self._entries.pop(self._fingerprint(presented), None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
