"""A real HTTP receiver for webhook tests: a threading http.server on 127.0.0.1 that answers
each POST with the next status of a script (200 once the script is used up) and hands every
request to the test through a queue."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]  # names in lower case
    body: str
    status: int
    at: float


class Receiver:
    def __init__(self, statuses: list[int] | None = None, location: str | None = None) -> None:
        self.requests: queue.Queue[Received] = queue.Queue()
        self._statuses = list(statuses or [])
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(length).decode()
                with receiver._lock:
                    status = receiver._statuses.pop(0) if receiver._statuses else 200
                self.send_response(status)
                if location is not None:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")
                receiver.requests.put(
                    Received(
                        self.path,
                        {k.lower(): v for k, v in self.headers.items()},
                        body,
                        status,
                        time.time(),
                    )
                )

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def next(self, timeout: float = 10.0) -> Received:
        return self.requests.get(timeout=timeout)

    def drain(self) -> list[Received]:
        found: list[Received] = []
        while True:
            try:
                found.append(self.requests.get_nowait())
            except queue.Empty:
                return found

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
