"""The dashboard's sign-in token: `v2.<key id>.<issued, unix ms>.<expiry, unix s>.<signature>`,
an HMAC-SHA256 over the rest with a server secret, carried in an HttpOnly cookie
(app.sessions.routes). Tokens of the first version, `v1.<key id>.<expiry>.<signature>`, are still
accepted until they expire, as issued before any sign-out.

The token holds no key material, only the key's id, when it was issued and when it stops being
accepted; every use still looks the key up (app.sessions.service.authenticate_session), so revoking
the key ends its sessions, and signing out ends those issued before. The secret comes from the
settings (GRPO_SESSION_SECRET) or, when unset, from a 0600 file (GRPO_SESSION_SECRET_FILE, by
default in the data folder) that the first API process creates, so every process sharing the
file signs alike and a restart signs nobody out.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

VERSION = "v2"
_FIRST_VERSION = "v1"  # no issue time: counts as issued before any sign-out
# Longest token this module ever issues (a key id is 40 characters at most): longer is refused
# before any work is done on it.
MAX_TOKEN_CHARS = 200


@dataclass(frozen=True)
class SessionClaims:
    key_id: str
    expires_at: int  # unix seconds
    issued_at_ms: int = 0  # unix milliseconds; 0 for a first-version token


def load_or_create_secret(path: Path, configured: str | None) -> bytes:
    """The configured secret, else the one in the file at `path` (created, 0600, with 256
    random bits if missing; a process that loses the race to create it reads the winner's)."""
    if configured:
        return configured.encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_secret(path)
    except OSError as exc:  # a read-only data folder, say
        raise RuntimeError(
            f"cannot create the session secret {path} ({exc.strerror}): set GRPO_SESSION_SECRET, "
            "or GRPO_SESSION_SECRET_FILE to a writable path"
        ) from exc
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return _read_secret(path)


def _read_secret(path: Path, attempts: int = 50) -> bytes:
    # A file another process has created but not written yet reads empty for a moment.
    for _ in range(attempts):
        text = path.read_text().strip()
        if text:
            return text.encode()
        time.sleep(0.01)
    raise RuntimeError(f"{path} is empty: delete it, or set GRPO_SESSION_SECRET")


class SessionTokens:
    """Issues and checks tokens with one secret and lifetime."""

    def __init__(self, secret: bytes, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self.ttl_s = ttl_s
        self._clock = clock

    def _sign(self, payload: str) -> str:
        digest = hmac.new(self._secret, payload.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def issue(self, key_id: str) -> tuple[str, SessionClaims]:
        if "." in key_id:
            raise ValueError(f"key id {key_id!r} must not contain '.'")
        now = self._clock()
        claims = SessionClaims(key_id, int(now + self.ttl_s), int(now * 1000))
        payload = f"{VERSION}.{claims.key_id}.{claims.issued_at_ms}.{claims.expires_at}"
        return f"{payload}.{self._sign(payload)}", claims

    def verify(self, token: str) -> SessionClaims | None:
        """The token's claims when it is well formed, signed with our secret and not expired."""
        if len(token) > MAX_TOKEN_CHARS:
            return None
        payload, _, signature = token.rpartition(".")
        parts = payload.split(".")
        if parts[0] == VERSION and len(parts) == 4:
            key_id, issued, expires = parts[1], parts[2], parts[3]
        elif parts[0] == _FIRST_VERSION and len(parts) == 3:
            key_id, issued, expires = parts[1], "0", parts[2]
        else:
            return None
        if not key_id:
            return None
        if not hmac.compare_digest(self._sign(payload).encode(), signature.encode()):
            return None
        try:
            issued_at_ms, expires_at = int(issued), int(expires)
        except ValueError:
            return None
        if expires_at <= self._clock():
            return None
        return SessionClaims(key_id, expires_at, issued_at_ms)
