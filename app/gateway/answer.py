"""A non-streamed answer of the engine, passed on as the engine's bytes.

With `n`, `max_tokens` and `top_logprobs` all within a tenant's limits, one answer reaches
~19 MiB, and parsing and re-serialising it on the event loop stalled every other
request of the API process (and once got both processes killed by their supervisor). So the
body is never parsed whole:

- it is read up to GRPO_INFERENCE_MAX_RESPONSE_BYTES (:func:`read_bounded`); past that only its
  tail is kept, for the usage, and the client gets a 400 `response_too_large`;
- `model` is rewritten in place (:func:`with_client_model`): the engine writes the top-level keys
  before `choices` (id, object, created, model), so only that head is decoded, value by value
  with json's own decoder (a token such as "model" inside `top_logprobs` is never mistaken for
  the key). An answer shaped otherwise is parsed whole, in a worker thread;
- the usage is read from the tail (:func:`usage_in`): `usage` is the one key of vLLM's answers
  whose value is an object holding `prompt_tokens`, and it follows `choices`;
- a chat whose tool calls are read (:func:`with_tool_calls`: tools it may call) is parsed whole,
  bounded like any answer, in a worker thread, and written back with the calls in OpenAI's
  shape (app.gateway.chat_as_trained).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from app.core.errors import InvalidRequest, UpstreamFailed
from app.gateway import chat_as_trained
from app.gateway.request_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    InferenceRequest,
)
from jobspec.prompt_format import TemplateTraits

SETTING = "GRPO_INFERENCE_MAX_RESPONSE_BYTES"
TAIL_BYTES = 64 * 1024  # the end of an answer kept for its usage (vLLM's: a few hundred bytes)
HEAD_BYTES = 16 * 1024  # where `model` must be found (vLLM's: within the first 200 bytes)
_USAGE = re.compile(rb'"usage"\s*:\s*(?=\{)')
_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class AnswerBody:
    content: bytes | None  # None: larger than the limit (dropped as it came)
    tail: bytes
    size: int


async def read_bounded(response: httpx.Response, limit: int) -> AnswerBody:
    """The whole body when it is at most `limit` bytes; else its size and its tail only. Read
    to the end either way, so the engine's usage of an oversized answer is still known."""
    parts: list[bytes] = []
    kept = 0
    tail = b""
    async for chunk in response.aiter_bytes():
        kept += len(chunk)
        if kept <= limit:
            parts.append(chunk)
        else:
            if parts:
                tail, parts = b"".join(parts)[-TAIL_BYTES:], []
            tail = (tail + chunk)[-TAIL_BYTES:]
    if kept <= limit:
        content = b"".join(parts)
        return AnswerBody(content, content[-TAIL_BYTES:], kept)
    return AnswerBody(None, tail, kept)


def usage_in(tail: bytes) -> dict[str, Any] | None:
    """The answer's `usage` object, read from its tail; None when there is none."""
    text = tail.decode("utf-8", "surrogateescape")
    found = list(_USAGE.finditer(tail))
    if not found:
        return None
    start = len(tail[: found[-1].end()].decode("utf-8", "surrogateescape"))
    try:
        usage, _ = _DECODER.raw_decode(text, start)
    except ValueError:
        return None
    return usage if isinstance(usage, dict) else None


def _skip(text: str, pos: int) -> int:
    match = _SPACE.match(text, pos)
    return match.end() if match else pos


def _model_span(head: str) -> tuple[int, int] | None:
    """Where the top-level `model` value lies in `head` (character offsets), when it comes
    before `choices`; None otherwise."""
    pos = _skip(head, 0)
    if not head.startswith("{", pos):
        return None
    pos += 1
    try:
        while True:
            key, pos = _DECODER.raw_decode(head, _skip(head, pos))
            pos = _skip(head, pos)
            if not isinstance(key, str) or key == "choices" or not head.startswith(":", pos):
                return None
            start = _skip(head, pos + 1)
            _, end = _DECODER.raw_decode(head, start)
            if key == "model":
                return start, end
            pos = _skip(head, end)
            if not head.startswith(",", pos):
                return None
            pos += 1
    except ValueError:  # the head ended inside a value, or it is not JSON
        return None


def _rewrite_whole(
    content: bytes, client_model: str, traits: TemplateTraits | None = None
) -> bytes:
    """The answer parsed, `model` set to the client's name and, with `traits`, the tool calls
    of each choice read out of its text."""
    try:
        data = json.loads(content)
    except ValueError as exc:
        raise UpstreamFailed("the inference engine's answer is not JSON; retry") from exc
    if not isinstance(data, dict):
        raise UpstreamFailed("the inference engine's answer is not a JSON object; retry")
    data["model"] = client_model
    if traits is not None:
        chat_as_trained.with_tool_calls(data, traits)
    return json.dumps(data, separators=(",", ":")).encode()


async def with_tool_calls(content: bytes, client_model: str, traits: TemplateTraits) -> bytes:
    """A chat answer with `model` set to the client's name and each choice's tool calls in
    OpenAI's shape (`tool_calls`, `finish_reason: "tool_calls"`), parsed off the event loop."""
    return await anyio.to_thread.run_sync(_rewrite_whole, content, client_model, traits)


async def with_client_model(content: bytes, client_model: str) -> bytes:
    """The answer with its top-level `model` set to the client's name (see the module doc)."""
    head = content[:HEAD_BYTES].decode("utf-8", "surrogateescape")
    span = _model_span(head)
    if span is None:
        return await anyio.to_thread.run_sync(_rewrite_whole, content, client_model)
    start, end = (len(head[:i].encode("utf-8", "surrogateescape")) for i in span)
    return content[:start] + json.dumps(client_model).encode() + content[end:]


class ResponseTooLarge(InvalidRequest):
    code = "response_too_large"


def _biggest_factor(body: InferenceRequest) -> str:
    """The field that grows the answer the most, as the client set it."""
    if isinstance(body, ChatCompletionRequest) and body.logprobs:
        return "top_logprobs" if body.top_logprobs else "logprobs"
    if isinstance(body, CompletionRequest) and body.logprobs:
        return "logprobs"
    if body.choices() > 1:
        return "n"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens:
        return "max_completion_tokens"
    return "max_tokens"


def too_large(body: InferenceRequest, size: int, limit: int) -> ResponseTooLarge:
    """The 400 of an answer past the limit, naming the field to lower."""
    return ResponseTooLarge(
        f"the answer is {size} bytes, more than this service passes on ({limit} bytes, "
        f"{SETTING}); ask for fewer choices, tokens or logprobs, or stream it (stream: true), "
        "which is passed on event by event; its tokens are counted",
        param=_biggest_factor(body),
    )
