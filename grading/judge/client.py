"""Calls of an OpenAI-compatible chat endpoint for the score_model grader: concurrent, bounded,
retried with exponential backoff and jitter, and never raising for what the endpoint does."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from grading.judge.settings import JudgeEndpoint, JudgeSettings

__all__ = ["JudgeReply", "chat_all"]

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


@dataclass(frozen=True)
class JudgeReply:
    """The judge's text, or why there is none (``timeout`` or ``error``) and a reason."""

    text: str | None
    failure: str | None = None
    reason: str | None = None


async def _one(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    settings: JudgeSettings,
    deadline: float,
    gate: asyncio.Semaphore,
) -> JudgeReply:
    delay = 0.5
    last = "no attempt"
    for attempt in range(settings.retries + 1):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return JudgeReply(None, "timeout", f"the batch ran out of time ({last})")
        try:
            async with gate:
                response = await client.post(
                    url, json=body, timeout=min(settings.timeout_s, remaining)
                )
        except httpx.TimeoutException:
            last = "the judge did not answer in time"
            failure = "timeout"
        except httpx.HTTPError as exc:
            last, failure = f"cannot reach the judge ({type(exc).__name__})", "error"
        else:
            if response.status_code == 200:
                if len(response.content) > settings.max_reply_bytes:
                    return JudgeReply(None, "error", "the judge's reply is over the size limit")
                try:
                    text = response.json()["choices"][0]["message"]["content"]
                except (ValueError, KeyError, IndexError, TypeError):
                    return JudgeReply(None, "error", "the judge's reply is not a chat completion")
                return JudgeReply(text if isinstance(text, str) else "")
            last, failure = f"the judge answered HTTP {response.status_code}", "error"
            if response.status_code not in RETRY_STATUS:
                return JudgeReply(None, failure, last)
        if attempt < settings.retries:
            # Exponential backoff with full jitter, within the batch's time.
            await asyncio.sleep(
                min(random.uniform(0, delay), max(0.0, deadline - time.monotonic()))
            )
            delay *= 2
    return JudgeReply(None, failure, last)


async def _all(
    endpoint: JudgeEndpoint, bodies: Sequence[dict[str, Any]], settings: JudgeSettings
) -> list[JudgeReply]:
    deadline = time.monotonic() + settings.batch_timeout_s
    gate = asyncio.Semaphore(settings.concurrency)
    headers = {}
    key = endpoint.api_key()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    limits = httpx.Limits(max_connections=settings.concurrency)
    # trust_env=False: the worker's proxy variables must not reroute a judge call (and a key
    # with it) to a host the operator did not configure.
    async with httpx.AsyncClient(
        headers=headers, limits=limits, follow_redirects=False, trust_env=False
    ) as client:
        url = f"{endpoint.base_url}/chat/completions"
        return list(
            await asyncio.gather(
                *(_one(client, url, body, settings, deadline, gate) for body in bodies)
            )
        )


def chat_all(
    endpoint: JudgeEndpoint, bodies: Sequence[dict[str, Any]], settings: JudgeSettings
) -> list[JudgeReply]:
    """POST each chat-completion request body to ``endpoint``; one reply per body, in order."""
    if not bodies:
        return []
    return asyncio.run(_all(endpoint, bodies, settings))


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
