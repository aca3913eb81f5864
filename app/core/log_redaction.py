"""Credentials never reach the access log: uvicorn logs each request's path with its query
string, and a client that puts a key in the URL (`?key=`, `?api_key=`, `?token=`, as some
EventSource examples do) would leave it in every log shipper and terminal that sees the line.
The API reads no credential from the query, but it cannot stop a client from sending one."""

from __future__ import annotations

import logging
from urllib.parse import parse_qsl, urlencode

__all__ = ["CREDENTIAL_PARAMS", "RedactCredentials", "install", "redact_url"]

# Query parameter names (compared without case) whose values are replaced in logged URLs.
CREDENTIAL_PARAMS = frozenset(
    {"key", "api_key", "apikey", "token", "access_token", "auth", "password", "secret", "session"}
)
REDACTED = "[redacted]"
ACCESS_LOGGER = "uvicorn.access"


def redact_url(path: str) -> str:
    """``path`` (a path with an optional query) with every credential parameter's value
    replaced by REDACTED; the rest as sent."""
    base, sep, query = path.partition("?")
    if not sep:
        return path
    pairs = parse_qsl(query, keep_blank_values=True)
    if not any(name.lower() in CREDENTIAL_PARAMS for name, _ in pairs):
        return path
    cleaned = [(n, REDACTED if n.lower() in CREDENTIAL_PARAMS else v) for n, v in pairs]
    return f"{base}?{urlencode(cleaned, safe='[]')}"


class RedactCredentials(logging.Filter):
    """Rewrites the path argument of uvicorn's access records: (client, method, path, HTTP
    version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_url(args[2]), *args[3:])
        return True


def install() -> None:
    """Add the filter to the access logger of this process, once (each API worker process
    builds its own app, and calls this)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, RedactCredentials) for f in logger.filters):
        logger.addFilter(RedactCredentials())
