"""Refuse request text the database cannot store, before any route runs.

Postgres refuses a NUL character in `text`/`jsonb` (psycopg raises before the query is sent),
so a job id, cursor, API key prefix or Idempotency-Key holding `%00` used to reach a query and
end as a 500. One ASGI middleware checks every path parameter, query parameter and header of
every request, present and future routes alike, and answers a 422 naming the parameter. Bodies
are checked where they are parsed: the job spec (`specbase.StrictModel`) and uploads
(`app.files.service`).

Only NUL needs refusing here: the server decodes the path and query as UTF-8 with replacement
and headers as latin-1, so no lone surrogate (the other unstorable text) can come out of them.
"""

from __future__ import annotations

from urllib.parse import parse_qsl

from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from app.core.error_handlers import error_response

NUL = "\x00"


def _path_param(scope: Scope) -> str:
    """The name of the path parameter holding the NUL, from the route the path matches."""
    app = scope.get("app")
    for route in getattr(getattr(app, "router", None), "routes", ()):
        match, child = route.matches(scope)
        if match != Match.NONE:
            for name, value in (child.get("path_params") or {}).items():
                if NUL in str(value):
                    return str(name)
    return "path"


def _printable(name: str) -> str:
    return name.replace(NUL, "").strip()[:64] or "?"


def find_nul(scope: Scope) -> str | None:
    """Where a NUL character sits in the request line or headers (a parameter name), or None.
    Cheap on the common path: byte searches before any parsing."""
    if NUL in scope.get("path", ""):
        return _path_param(scope)
    query: bytes = scope.get("query_string", b"")
    if b"\x00" in query or b"%00" in query:
        for key, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
            if NUL in key or NUL in value:
                return _printable(key) if NUL not in key else "query"
    for name, value in scope.get("headers", ()):
        if b"\x00" in name or b"\x00" in value:
            if b"\x00" in name:
                return "headers"
            return "-".join(
                part.capitalize() for part in _printable(name.decode("latin-1")).split("-")
            )
    return None


class RejectNul:
    """Pure ASGI middleware: a request with a NUL in its path, query or headers gets a 422
    naming the parameter, in the service's one error shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            param = find_nul(scope)
            if param is not None:
                response = error_response(
                    422,
                    "invalid_request_error",
                    f"{param} must not contain NUL characters (\\u0000)",
                    param,
                    code="invalid_value",
                    path=scope.get("path", ""),
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
