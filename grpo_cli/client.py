"""A small HTTP client for the grpo-service API (httpx), used by the CLI, the demo and CI."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx


class ApiError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        self.status = status
        self.type = error.get("type", "http_error")
        self.param = error.get("param")
        super().__init__(f"{status} {self.type}: {error.get('message', body)}")


@dataclass(frozen=True)
class StreamMessage:
    event: str
    data: dict[str, Any]
    id: str | None


class Client:
    def __init__(self, base_url: str, api_key: str, timeout: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _json(self, response: httpx.Response) -> dict[str, Any]:
        body = response.json() if response.content else {}
        if response.status_code >= 400:
            raise ApiError(response.status_code, body)
        return dict(body)

    def create_job(
        self, spec: dict[str, Any], idempotency_key: str | None = None
    ) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._json(self._http.post("/v1/jobs", json=spec, headers=headers))

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._json(self._http.get(f"/v1/jobs/{job_id}"))

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return list(self._json(self._http.get(f"/v1/jobs/{job_id}/checkpoints"))["data"])

    def stream(
        self, job_id: str, last_event_id: str | None = None, max_reconnects: int = 20
    ) -> Iterator[StreamMessage]:
        """Follow the job's SSE stream to its end, reconnecting with Last-Event-ID after a
        dropped connection, so every message arrives exactly once."""
        reconnects = 0
        while True:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
            try:
                with self._http.stream(
                    "GET",
                    f"/v1/jobs/{job_id}/stream",
                    headers=headers,
                    timeout=httpx.Timeout(30, read=60),
                ) as response:
                    if response.status_code >= 400:
                        response.read()
                        self._json(response)
                    for message in parse_sse(response.iter_lines()):
                        if message.id is not None:
                            last_event_id = message.id
                        yield message
                        if message.event == "end":
                            return
            except (httpx.TransportError, httpx.RemoteProtocolError):
                pass
            reconnects += 1
            if reconnects > max_reconnects:
                raise ConnectionError(f"stream of {job_id} dropped {reconnects} times")
            time.sleep(min(2.0, 0.2 * reconnects))


def parse_sse(lines: Iterator[str]) -> Iterator[StreamMessage]:
    event, data, message_id = "message", "", None
    for line in lines:
        if line == "":
            if data:
                yield StreamMessage(event, json.loads(data), message_id)
            event, data, message_id = "message", "", None
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
        elif line.startswith("id:"):
            message_id = line[3:].strip()
