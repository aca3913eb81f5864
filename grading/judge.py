"""Calls of an OpenAI-compatible chat endpoint for the score_model grader: concurrent, bounded
(the operator endpoints' one client, :func:`grading.endpoints.run_calls`), retried with exponential backoff
and jitter, and never raising for what the endpoint does."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grading.endpoints import (
    EndpointCalls,
    EndpointFailure,
    JudgeEndpoint,
    JudgeSettings,
    run_calls,
)

__all__ = ["JudgeReply", "chat_all", "request_body"]


@dataclass(frozen=True)
class JudgeReply:
    """The judge's text, or why there is none (``timeout`` or ``error``) and a reason."""

    text: str | None
    failure: str | None = None
    reason: str | None = None


def _reply(answer: Any) -> JudgeReply:
    try:
        text = answer["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return JudgeReply(None, "error", "the judge's reply is not a chat completion")
    return JudgeReply(text if isinstance(text, str) else "")


def _call(
    endpoint: JudgeEndpoint, body: dict[str, Any], settings: JudgeSettings, deadline: float
) -> Callable[[EndpointCalls], Awaitable[JudgeReply]]:
    async def call(calls: EndpointCalls) -> JudgeReply:
        delay = 0.5
        last, failure = "no attempt", "error"
        for attempt in range(settings.retries + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return JudgeReply(None, "timeout", f"the batch ran out of time ({last})")
            try:
                answer = await calls.post_json(
                    endpoint,
                    "/chat/completions",
                    body,
                    timeout_s=min(settings.timeout_s, remaining),
                    max_bytes=settings.max_reply_bytes,
                )
            except EndpointFailure as exc:
                last, failure = f"judge: {exc}", "timeout" if exc.timed_out else "error"
                if not exc.retryable:
                    return JudgeReply(None, failure, last)
            else:
                return _reply(answer)
            if attempt < settings.retries:
                # Exponential backoff with full jitter, within the batch's time.
                await asyncio.sleep(
                    min(random.uniform(0, delay), max(0.0, deadline - time.monotonic()))
                )
                delay *= 2
        return JudgeReply(None, failure, last)

    return call


def chat_all(
    endpoint: JudgeEndpoint, bodies: Sequence[dict[str, Any]], settings: JudgeSettings
) -> list[JudgeReply]:
    """POST each chat-completion request body to ``endpoint``; one reply per body, in order,
    all within ``settings.batch_timeout_s``."""
    deadline = time.monotonic() + settings.batch_timeout_s
    calls = [_call(endpoint, body, settings, deadline) for body in bodies]
    return run_calls(calls, settings.concurrency)


def request_body(
    model: str, messages: list[dict[str, str]], params: dict[str, Any]
) -> dict[str, Any]:
    """A chat-completions request: the judge model, its messages, the sampling settings."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "temperature": params["temperature"],
        "top_p": params["top_p"],
        "max_tokens": params["max_completions_tokens"],
    }
    for optional in ("seed", "reasoning_effort"):
        if params.get(optional) is not None:
            body[optional] = params[optional]
    return body
