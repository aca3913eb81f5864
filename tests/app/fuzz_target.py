"""The app as the header and upload fuzz tests (test_header_fuzz.py, test_upload_fuzz.py) drive
it: requests go in as raw ASGI messages, so header bytes reach the app exactly as sent (the test
client would re-encode them as UTF-8), and each answer is held to the published schema."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import anyio
import httpx
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.core.responses import ErrorResponse

Headers = dict[str, str | bytes]


class Target:
    """The app under fuzzing, one project's credentials, and what the published schema
    documents for each operation. Use ``client`` (a started TestClient) to set things up and
    ``request`` to send what is fuzzed."""

    def __init__(self, app: FastAPI, key: str) -> None:
        self.app = app
        self.auth: Headers = {"Authorization": f"Bearer {key}"}
        self.client = TestClient(app)
        self.schema: dict[str, Any] = app.openapi()

    def request(
        self,
        method: str,
        path: str,
        *,
        headers: Headers | None = None,
        params: dict[str, str] | None = None,
        content: bytes = b"",
    ) -> httpx.Response:
        """Send one request on the test client's event loop (the app's). Of an event stream,
        only the status and headers are read: the client then goes away."""
        raw = [
            (name.lower().encode("latin-1"), value if isinstance(value, bytes) else value.encode())
            for name, value in (headers or {}).items()
        ]
        query = urlencode(params or {}).encode()
        assert self.client.portal is not None, "use the Target inside its fixture"
        return self.client.portal.call(_asgi_request, self.app, method, path, query, raw, content)

    def documented(self, method: str, path: str) -> set[int]:
        operation = self.schema["paths"][path][method.lower()]
        return {int(code) for code in operation["responses"]}

    def check(self, method: str, path: str, response: httpx.Response, what: object) -> None:
        """No 5xx, a status the schema documents for the operation (``path`` as the schema
        spells it), and an error in the one error shape, with its type, message and code."""
        where = f"{method} {path} with {what!r:.400}"
        status = response.status_code
        assert status < 500, (where, status, response.text[:300])
        assert status in self.documented(method, path), (where, status, response.text[:300])
        if status >= 400:
            assert response.headers["content-type"].startswith("application/json"), where
            error = ErrorResponse.model_validate(response.json()).error
            assert error.type and error.message and error.code, (where, error)


async def _asgi_request(
    app: FastAPI,
    method: str,
    path: str,
    query: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
) -> httpx.Response:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    start: dict[str, Any] = {}
    chunks: list[bytes] = []
    finished = anyio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
            if (
                dict(message.get("headers", []))
                .get(b"content-type", b"")
                .startswith(b"text/event-stream")
            ):
                finished.set()  # a stream runs until the client leaves: it leaves now
        elif message["type"] == "http.response.body" and not finished.is_set():
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                finished.set()

    with anyio.fail_after(30):
        try:
            await app(scope, receive, send)
        except Exception:
            if not start:  # the error middleware answers a 500 first, then re-raises
                raise
    return httpx.Response(start["status"], headers=start["headers"], content=b"".join(chunks))
