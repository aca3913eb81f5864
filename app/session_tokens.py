"""The dashboard's sign-in token: `v1.<key id>.<expiry>.<signature>`, an HMAC-SHA256 over the
rest with a server secret, carried in an HttpOnly cookie (app.routes.session).

The token holds no key material, only the key's id and when it stops being accepted; every use
still looks the key up (app.services.keys.authenticate_session), so revoking the key ends its
sessions. The secret comes from the settings (GRPO_SESSION_SECRET) or, when unset, from a 0600
file (GRPO_SESSION_SECRET_FILE, by default in the data folder) that the first API process
creates, so every process sharing the file signs alike and a restart signs nobody out.
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

VERSION = "v1"
# Longest token this module ever issues (a key id is 40 characters at most): longer is refused
# before any work is done on it.
MAX_TOKEN_CHARS = 200


@dataclass(frozen=True)
class SessionClaims:
    key_id: str
    expires_at: int  # unix seconds


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
        claims = SessionClaims(key_id, int(self._clock() + self.ttl_s))
        payload = f"{VERSION}.{claims.key_id}.{claims.expires_at}"
        return f"{payload}.{self._sign(payload)}", claims

    def verify(self, token: str) -> SessionClaims | None:
        """The token's claims when it is well formed, signed with our secret and not expired."""
        if len(token) > MAX_TOKEN_CHARS:
            return None
        payload, _, signature = token.rpartition(".")
        parts = payload.split(".")
        if len(parts) != 3 or parts[0] != VERSION or not parts[1]:
            return None
        if not hmac.compare_digest(self._sign(payload).encode(), signature.encode()):
            return None
        try:
            expires_at = int(parts[2])
        except ValueError:
            return None
        if expires_at <= self._clock():
            return None
        return SessionClaims(parts[1], expires_at)
