"""Forwarding a chat or completion request to the vLLM OpenAI server that has the weights, and
reading its answer back in the client's terms.

- The body is the client's, validated (app.inference.request_schemas), with `model` replaced by
  the name the engine serves it under. A stream always asks for usage
  (`stream_options.include_usage`), so the gateway can count tokens; the usage chunk is dropped
  again when the client did not ask for it.
- Every `model` field of the answer, and of each chunk, is the client's name again.
- The engine's 4xx (a prompt past the model's context, a schema it cannot compile) becomes the
  same status with OpenAI's error body, its message and `param` kept; a 5xx, a dropped
  connection or a timeout is a 502 or 504.

The SSE relay (:class:`SseRelay`) works event by event, never holding more than one event:
each is parsed, rewritten and handed on as it arrives.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from app.core.errors import ApiError, UpstreamFailed, UpstreamRefused
from app.inference.request_schemas import ChatCompletionRequest, InferenceRequest

Endpoint = Literal["chat/completions", "completions"]

# vLLM's own spelling of the parameter a refusal is about, and the request field it means.
_PARAMS = {"input_tokens": None, "prompt_tokens": None}
_PARAM_IN_MESSAGE = re.compile(r"\s*\(parameter=[^)]*\)\s*$")
MAX_ERROR_BYTES = 64 * 1024


def endpoint_of(body: InferenceRequest) -> Endpoint:
    return "chat/completions" if isinstance(body, ChatCompletionRequest) else "completions"


def prompt_field(body: InferenceRequest) -> str:
    return "messages" if isinstance(body, ChatCompletionRequest) else "prompt"


def upstream_body(body: InferenceRequest, served_model: str) -> dict[str, Any]:
    """What is sent to the engine: the fields the client set, `model` replaced; a stream asks
    for usage."""
    data = body.model_dump(mode="json", exclude_unset=True, by_alias=True)
    data["model"] = served_model
    if body.stream:
        data["stream_options"] = {**(data.get("stream_options") or {}), "include_usage": True}
    return data


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def of(cls, data: Any) -> Usage | None:
        if not isinstance(data, dict):
            return None
        try:
            return cls(
                max(0, int(data.get("prompt_tokens") or 0)),
                max(0, int(data.get("completion_tokens") or 0)),
            )
        except (TypeError, ValueError):
            return None


def rewrite_answer(data: Any, client_model: str) -> Any:
    """A JSON answer (or chunk) with `model` set back to the client's name."""
    if isinstance(data, dict) and "model" in data:
        data["model"] = client_model
    return data


def upstream_error(
    status: int, content: bytes, *, body: InferenceRequest, served_model: str
) -> ApiError:
    """The engine's error answer as the client's: a 4xx keeps its status, message and param
    (vLLM's `input_tokens` is the request's prompt); anything else is a 502."""
    message, param = "", None
    try:
        data = json.loads(content[:MAX_ERROR_BYTES])
        error = data.get("error", data) if isinstance(data, dict) else {}
        if isinstance(error, dict):
            message = str(error.get("message") or "")
            raw = error.get("param")
            param = str(raw) if isinstance(raw, str) and raw else None
    except ValueError:
        message = content[:2000].decode("utf-8", "replace")
    message = message.replace(served_model, body.model)[:4000] if served_model else message
    if 400 <= status < 500 and status not in (401, 403, 408, 429):
        if param in _PARAMS or param is None:
            param = prompt_field(body) if "context length" in message else param
        return UpstreamRefused(
            _PARAM_IN_MESSAGE.sub("", message) or f"the inference engine refused it ({status})",
            status_code=status,
            param=param,
        )
    return UpstreamFailed(
        f"the inference engine failed ({status}): {message[:500] or 'no detail'}; retry later"
    )


class SseRelay:
    """Feeds on the engine's SSE bytes and gives back the client's: each `data:` event with
    `model` rewritten; the usage chunk (no choices) kept only when the client asked for it;
    `data: [DONE]` as it comes. Records the usage it saw, and counts content chunks so that a
    stream left early still has an estimate of what it generated."""

    def __init__(self, client_model: str, *, include_usage: bool) -> None:
        self.client_model = client_model
        self.include_usage = include_usage
        self.usage: Usage | None = None
        self.chunks = 0
        self.done = False
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        out: list[bytes] = []
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                return out
            event, self._buffer = self._buffer[:end], self._buffer[end + 2 :]
            relayed = self._event(event)
            if relayed is not None:
                out.append(relayed)

    def _event(self, event: bytes) -> bytes | None:
        lines = event.replace(b"\r\n", b"\n").split(b"\n")
        payload = b"\n".join(
            line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:")
        ).strip()
        if not payload:
            return None  # comments and keep-alives carry nothing for the client
        if payload == b"[DONE]":
            self.done = True
            return b"data: [DONE]\n\n"
        try:
            chunk = json.loads(payload)
        except ValueError:
            return b"data: " + payload + b"\n\n"
        if not isinstance(chunk, dict):
            return b"data: " + payload + b"\n\n"
        usage = Usage.of(chunk.get("usage"))
        if usage is not None:
            self.usage = usage
        choices = chunk.get("choices")
        if usage is not None and not choices and not self.include_usage:
            return None
        if choices:
            self.chunks += 1
        if not self.include_usage:
            chunk.pop("usage", None)
        rewrite_answer(chunk, self.client_model)
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    def estimated_usage(self) -> Usage:
        """The engine's usage when it came; else (a stream left early) the content chunks
        received as completion tokens (vLLM sends about one a token) and no prompt tokens."""
        return self.usage or Usage(0, self.chunks)


def completion_url(base_url: str, endpoint: Endpoint) -> str:
    return f"{base_url.rstrip('/')}/v1/{endpoint}"


def timeouts(read_s: float) -> httpx.Timeout:
    return httpx.Timeout(connect=5.0, read=read_s, write=30.0, pool=5.0)
