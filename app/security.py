"""API keys: `grpo_<prefix>_<secret>`. The prefix finds the row, the secret is compared against a
SHA-256 digest in constant time. Secrets are 256-bit random, so a fast hash is enough (no
password-stretching needed) and the plaintext never touches the database or the logs."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

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
