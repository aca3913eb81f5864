"""Request body size limit as plain ASGI middleware, so an oversized body is refused while it
streams in (Content-Length checked first, then the bytes actually received)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.error_handlers import error_response


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The one error shape, as the HTTPException below renders through the app's handler.
        response = error_response(
            413,
            "payload_too_large",
            f"request body exceeds {self.max_bytes} bytes",
            path=scope.get("path", ""),
        )
        response.headers["connection"] = "close"
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            # A body without Content-Length (chunked) is counted as it arrives; the
            # HTTPException surfaces through the app's handler as the same 413 body.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, f"request body exceeds {self.max_bytes} bytes")
            return message

        await self.app(scope, limited_receive, send)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"BodySizeLimit(max_bytes={self.max_bytes})"
