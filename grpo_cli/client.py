"""A small HTTP client for the grpo-service API (httpx), used by the CLI, the demo and CI."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import httpx

# Steps per page of a raw metrics read (the server's largest page).
METRICS_PAGE_STEPS = 10_000


class ApiError(Exception):
    def __init__(self, status: int, body: dict[str, Any], retry_after: float | None = None) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        self.status = status
        self.retry_after = retry_after  # seconds, from a 429/503's Retry-After header
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
        try:
            body = response.json() if response.content else {}
        except ValueError:
            # A proxy or load balancer in front of the API may answer with HTML or plain text.
            body = {"error": {"type": "http_error", "message": response.text[:300]}}
            if response.status_code < 400:
                raise ApiError(response.status_code, body) from None
        if response.status_code >= 400:
            raise ApiError(response.status_code, body, _retry_after(response))
        return dict(body)

    def create_job(
        self, spec: dict[str, Any], idempotency_key: str | None = None
    ) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._json(self._http.post("/v1/jobs", json=spec, headers=headers))

    def validate_job(self, spec: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/jobs/validate: the resolved spec, warnings and the memory plan."""
        return self._json(self._http.post("/v1/jobs/validate", json=spec))

    def submit_job(
        self, spec: dict[str, Any], idempotency_key: str | None = None
    ) -> tuple[dict[str, Any], bool]:
        """Like create_job, and also says whether the server replayed an earlier job created
        with the same Idempotency-Key (True) instead of creating a new one."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        response = self._http.post("/v1/jobs", json=spec, headers=headers)
        body = self._json(response)
        return body, response.headers.get("Idempotent-Replayed", "").lower() == "true"

    def list_webhooks(self, limit: int = 100, after: str | None = None) -> dict[str, Any]:
        """One page of the project's webhook endpoints, newest first."""
        params: dict[str, Any] = {"limit": limit}
        if after:
            params["after"] = after
        return self._json(self._http.get("/v1/webhooks", params=params))

    def create_webhook(
        self, url: str, events: list[str], description: str | None = None
    ) -> dict[str, Any]:
        """A new endpoint; the answer holds its signing secret, shown only this once."""
        body = {"url": url, "events": events, "description": description}
        return self._json(self._http.post("/v1/webhooks", json=body))

    def ensure_webhook(self, url: str, events: list[str]) -> tuple[dict[str, Any], bool]:
        """The project's endpoint for exactly `url`, created (with `events`) when there is none;
        True when it was created now."""
        after: str | None = None
        while True:
            page = self.list_webhooks(after=after)
            for endpoint in page["data"]:
                if endpoint["url"] == url:
                    return endpoint, False
            if not page["has_more"]:
                return self.create_webhook(url, events, "created by grpo submit --webhook"), True
            after = page["next_after"]

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._json(self._http.get(f"/v1/jobs/{job_id}"))

    def list_jobs(
        self, statuses: list[str] | None = None, limit: int = 20, after: str | None = None
    ) -> dict[str, Any]:
        """One page, newest first: {"data": [job...], "has_more", "next_after"}."""
        params: list[tuple[str, Any]] = [("limit", limit)]
        params += [("status", s) for s in statuses or []]
        if after:
            params.append(("after", after))
        return self._json(self._http.get("/v1/jobs", params=params))

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self.control_job(job_id, "cancel")

    def control_job(self, job_id: str, action: str) -> dict[str, Any]:
        """POST /v1/jobs/{id}/{action}: cancel, pause or resume (all idempotent)."""
        if action not in ("cancel", "pause", "resume"):
            raise ValueError(f"unknown job action {action!r}")
        return self._json(self._http.post(f"/v1/jobs/{job_id}/{action}"))

    def resume_job(self, job_id: str, changes: dict[str, int | float]) -> dict[str, Any]:
        """POST /v1/jobs/{id}/resume with settings to change (a paused job's; a retry of one
        that already resumed with them returns the job as is)."""
        body = {"set": changes}
        return self._json(self._http.post(f"/v1/jobs/{job_id}/resume", json=body))

    def events(self, job_id: str, after: int | None = None, limit: int = 1000) -> dict[str, Any]:
        """One page of the audit log, oldest first: {"data", "has_more", "next_after"}."""
        params: dict[str, int] = {"limit": limit}
        if after is not None:
            params["after"] = after
        return self._json(self._http.get(f"/v1/jobs/{job_id}/events", params=params))

    def all_events(self, job_id: str) -> list[dict[str, Any]]:
        """Every event so far, following the cursor."""
        out: list[dict[str, Any]] = []
        after: int | None = None
        while True:
            page = self.events(job_id, after=after)
            out += page["data"]
            if not page["has_more"]:
                return out
            after = page["next_after"]

    def metrics(
        self,
        job_id: str,
        names: list[str] | None = None,
        step_from: int | None = None,
        step_to: int | None = None,
        max_points: int | None = None,
    ) -> dict[str, Any]:
        """{"steps", "available", "series": {name: [{"step", "value", "min", "max", "count"}]}}.

        Without `max_points` the server answers one point per step a page at a time; this
        follows `next_step_from` and returns every step of the range in one body."""
        params: list[tuple[str, Any]] = [("names", n) for n in names or []]
        for key, value in (("step_to", step_to), ("max_points", max_points)):
            if value is not None:
                params.append((key, value))
        if max_points is None:
            params.append(("limit", METRICS_PAGE_STEPS))
        url = f"/v1/jobs/{job_id}/metrics"
        start = [("step_from", step_from)] if step_from is not None else []
        body: dict[str, Any] = self._json(self._http.get(url, params=params + start))
        while max_points is None and body.get("next_step_from") is not None:
            start = [("step_from", body["next_step_from"])]
            page = self._json(self._http.get(url, params=params + start))
            for name, points in page["series"].items():
                body["series"].setdefault(name, []).extend(points)
            body["next_step_from"] = page.get("next_step_from")
        return body

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return list(self._json(self._http.get(f"/v1/jobs/{job_id}/checkpoints"))["data"])

    def download_checkpoint(
        self,
        job_id: str,
        step: int,
        into: IO[bytes],
        on_progress: Callable[[int, int | None], None] | None = None,
    ) -> int:
        """Stream the checkpoint's tar archive into `into`; returns the bytes written.
        `on_progress(bytes_so_far, total_or_None)` is called after each chunk. A body shorter
        than its Content-Length raises httpx.RemoteProtocolError (a TransportError)."""
        url = f"/v1/jobs/{job_id}/checkpoints/{step}/download"
        with self._http.stream("GET", url, timeout=httpx.Timeout(30, read=300)) as response:
            if response.status_code >= 400:
                response.read()
                self._json(response)
            total = int(response.headers.get("content-length") or 0) or None
            written = 0
            for chunk in response.iter_bytes(1024 * 1024):
                into.write(chunk)
                written += len(chunk)
                if on_progress is not None:
                    on_progress(written, total)
        if total is not None and written != total:
            raise httpx.RemoteProtocolError(f"the download ended after {written} of {total} bytes")
        return written

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

    def chat_stream(
        self, model: str, messages: list[dict[str, str]], **params: Any
    ) -> Iterator[str]:
        """Stream a chat completion (POST /v1/chat/completions, ``stream: true``): the text of
        each chunk as it arrives. A refusal before the first chunk (a 503 while the model's
        engine starts, a 429) raises ApiError with the server's ``retry_after``."""
        body = {"model": model, "messages": messages, "stream": True, **params}
        timeout = httpx.Timeout(30, read=300)
        with self._http.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code >= 400:
                r.read()
                self._json(r)
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:  # an error after the stream began (vLLM sends one so)
                    raise ApiError(500, chunk)
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        yield text


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        return None


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
