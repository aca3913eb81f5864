"""The operator's endpoints: where a job's judge, http tools and http environment may call.

Two variables of the API's and the workers' environment register them, by name:

- ``GRPO_JUDGE_ENDPOINTS``: the judges of ``score_model`` graders (``endpoint: NAME``), OpenAI-
  compatible chat APIs: ``{"local": {"base_url": "http://judge:8001/v1", "api_key_env":
  "JUDGE_KEY", "model": "served-model-name"}}`` (``model`` optional);
- ``GRPO_TOOL_ENDPOINTS``: http tools (``implementation: {type: http, endpoint: NAME}``) and
  http environments (``environment: {type: http, endpoint: NAME}``): ``{"calc": {"url":
  "http://tools:9000/calc", "api_key_env": "CALC_KEY"}}``.

A job names an endpoint; its URL and key stay in the environment of the API (which refuses an
unknown name at submission: :func:`unknown_endpoint`) and of the workers (which call it), so a
tenant can neither point the service at an address of its choosing nor read a key.

Every call goes through the one client here (:func:`run_calls`; the judge's, http tools' and
http environments'), bounded on every side an endpoint controls: each call within its time
limit (all of it: connecting, sending, every chunk of the answer), an answer of at most
``max_bytes`` (a declared length over it is refused before reading, a streamed one is cut at
it, and none comes compressed), at most ``concurrency`` requests in flight. Redirects are not
followed and the process's proxy variables and ``.netrc`` are not used (``trust_env=False``), so
a call and its key go to the registered URL only. What goes wrong is an
:class:`EndpointFailure` whose message never carries the URL: the model, and the job's owner
through samples and events, read it.

The protocol of tools and environments (the workers' side is :mod:`worker.agents`; every call
a JSON POST, with ``Authorization: Bearer <key>`` when the endpoint has one):

- a tool: ``POST <url>`` with ``{"name": tool, "arguments": {...}}``; it answers
  ``{"content": "..."}`` (what the model reads) or ``{"error": "..."}`` (a tool error the model
  reads too);
- an environment: ``POST <url>/reset`` with ``{"episode_id", "item"}`` answers the messages
  that open the episode (a list of ``{role: user|system|tool, content}``), ``POST <url>/step``
  with ``{"episode_id", "messages"}`` (the assistant's turn) answers ``{"messages", "reward",
  "done"}``.

A call that times out (``episode.tool_timeout_s``), fails (connection, any status but 2xx),
answers more than ``GRPO_TOOL_MAX_RESPONSE_BYTES`` or answers something else is a tool error
(the model reads why) or ends the episode with reason error; it never fails the job. The judge's
calls are retried and bounded by ``GRPO_JUDGE_*`` (docs/graders.md).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import httpx
from pydantic import BaseModel, Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "ENDPOINT_NAME_PATTERN",
    "RETRY_STATUS",
    "EndpointCalls",
    "EndpointFailure",
    "EndpointKind",
    "JudgeEndpoint",
    "JudgeSettings",
    "OperatorEndpoint",
    "ToolEndpoint",
    "ToolEndpointSettings",
    "build_judge_settings",
    "build_tool_endpoint_settings",
    "run_calls",
    "unknown_endpoint",
]

# What a job may name: the rule of every endpoint field of the spec.
ENDPOINT_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"

EndpointKind = Literal["judge", "tool"]
_VARIABLES: dict[EndpointKind, str] = {
    "judge": "GRPO_JUDGE_ENDPOINTS",
    "tool": "GRPO_TOOL_ENDPOINTS",
}


def _http_url(value: str, info: ValidationInfo) -> str:
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"{info.field_name} must be an http(s) URL")
    return value.rstrip("/")


class OperatorEndpoint(BaseModel):
    """An endpoint of the operator's: where it is (:attr:`root_url`) and its key."""

    api_key_env: str | None = Field(
        default=None, description="The environment variable holding its key (none: no key)."
    )

    @property
    def root_url(self) -> str:
        """The URL its calls' paths are relative to."""
        raise NotImplementedError

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class JudgeEndpoint(OperatorEndpoint):
    base_url: str = Field(description="An OpenAI-compatible API root, e.g. http://judge:8001/v1.")
    model: str | None = Field(
        default=None,
        description=(
            "The model this endpoint serves. When set, every call asks for it, whatever model "
            "the grader names: a grader written for OpenAI (model gpt-4o-2024-08-06) runs on "
            "this judge unchanged. Unset: the grader's model is sent as it is."
        ),
    )

    _http = field_validator("base_url")(_http_url)

    @property
    def root_url(self) -> str:
        return self.base_url


class ToolEndpoint(OperatorEndpoint):
    url: str = Field(description="The endpoint's http(s) URL (environments: reset/step below).")

    _http = field_validator("url")(_http_url)

    @property
    def root_url(self) -> str:
        return self.url


class JudgeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GRPO_JUDGE_", extra="ignore")

    endpoints: dict[str, JudgeEndpoint] = Field(default_factory=dict)
    timeout_s: float = Field(default=60.0, gt=0, le=600, description="One judge call.")
    batch_timeout_s: float = Field(default=900.0, gt=0, le=7200, description="One batch.")
    concurrency: int = Field(default=8, ge=1, le=256, description="Calls in flight.")
    retries: int = Field(default=3, ge=0, le=10, description="Retries of a failed call.")
    max_reply_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20)


class ToolEndpointSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GRPO_TOOL_", extra="ignore")

    endpoints: dict[str, ToolEndpoint] = Field(default_factory=dict)
    max_response_bytes: int = Field(
        default=1 << 20, ge=1024, le=64 << 20, description="Of one answer; more is an error."
    )
    concurrency: int = Field(
        default=16, ge=1, le=256, description="Calls of one turn in flight at once."
    )


def build_judge_settings(**overrides: object) -> JudgeSettings:
    """The judge settings from the environment, with ``overrides`` on top (tests)."""
    return JudgeSettings(**overrides)  # type: ignore[arg-type]


def build_tool_endpoint_settings(**overrides: object) -> ToolEndpointSettings:
    """The tool endpoint settings from the environment, with ``overrides`` on top (tests)."""
    return ToolEndpointSettings(**overrides)  # type: ignore[arg-type]


def unknown_endpoint(
    kind: EndpointKind, named: Iterable[tuple[str, str]]
) -> tuple[str, str] | None:
    """The first of ``named`` (``(field, endpoint name)`` pairs of a job) that is not one of the
    operator's ``kind`` endpoints here, with a message that lists those it knows; None when
    every name is registered."""
    pairs = list(named)
    if not pairs:
        return None
    settings = build_judge_settings() if kind == "judge" else build_tool_endpoint_settings()
    known = set(settings.endpoints)
    for where, name in pairs:
        if name not in known:
            names = ", ".join(sorted(known)) or "none are configured"
            return where, (
                f"{kind} endpoint {name!r} is not one of this service's ({names}); the "
                f"operator registers them in {_VARIABLES[kind]}"
            )
    return None


# ---- the one client ---------------------------------------------------------------------------

T = TypeVar("T")

# Statuses that say "not now" rather than "no": worth a retry where the caller retries (the
# judge; a tool call is the model's to repeat).
RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class EndpointFailure(Exception):
    """Why a call got no usable answer, in words fit for the model and the job's owner.
    ``timed_out``: it ran past its limit; ``retryable``: the same call may succeed later (a
    timeout, a failed connection, a status of :data:`RETRY_STATUS`)."""

    def __init__(self, reason: str, *, timed_out: bool = False, retryable: bool = False) -> None:
        super().__init__(reason)
        self.timed_out = timed_out
        self.retryable = retryable


class EndpointCalls:
    """One batch's client: :meth:`post_json` within the batch's bounds."""

    def __init__(self, client: httpx.AsyncClient, gate: asyncio.Semaphore) -> None:
        self._client = client
        self._gate = gate

    async def post_json(
        self,
        endpoint: OperatorEndpoint,
        path: str,
        body: Mapping[str, Any],
        *,
        timeout_s: float,
        max_bytes: int,
    ) -> Any:
        """POST ``body`` to ``endpoint.root_url + path`` (with its key, when it has one); its
        JSON answer, read within ``timeout_s`` and at most ``max_bytes`` long."""
        content = json.dumps(body, default=str).encode()
        # identity: the bound is on the bytes parsed, and no compressed answer can expand past it
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if (key := endpoint.api_key()) is not None:
            headers["Authorization"] = f"Bearer {key}"
        request = self._client.build_request(
            "POST", endpoint.root_url + path, content=content, headers=headers
        )
        try:
            async with self._gate:
                raw = await asyncio.wait_for(self._exchange(request, max_bytes), timeout_s)
        except TimeoutError:
            raise EndpointFailure(
                f"the endpoint gave no answer within {timeout_s:g} s",
                timed_out=True,
                retryable=True,
            ) from None
        except httpx.HTTPError as exc:  # its message may name the URL: only the kind goes on
            raise EndpointFailure(
                f"the call failed ({type(exc).__name__})", retryable=True
            ) from None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise EndpointFailure("the endpoint's answer is not JSON") from None

    async def _exchange(self, request: httpx.Request, max_bytes: int) -> bytes:
        response = await self._client.send(request, stream=True)
        try:
            status = response.status_code
            if not 200 <= status < 300:
                raise EndpointFailure(
                    f"the endpoint answered HTTP {status}", retryable=status in RETRY_STATUS
                )
            too_long = f"the endpoint's answer is over {max_bytes} bytes"
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise EndpointFailure(too_long)
            chunks, size = [], 0
            async for chunk in response.aiter_raw():
                size += len(chunk)
                if size > max_bytes:
                    raise EndpointFailure(too_long)
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            await response.aclose()


def run_calls(
    calls: Sequence[Callable[[EndpointCalls], Awaitable[T]]], concurrency: int
) -> list[T]:
    """Run ``calls`` on one client, at most ``concurrency`` requests in flight; their results
    in order."""

    async def all_of() -> list[T]:
        gate = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(
            limits=limits, follow_redirects=False, trust_env=False, timeout=None
        ) as client:
            batch = EndpointCalls(client, gate)
            return await asyncio.gather(*(call(batch) for call in calls))

    return asyncio.run(all_of()) if calls else []
