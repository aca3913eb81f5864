"""The worker's side of agent jobs (issue 27): http tools and http environments on the
operator's registered endpoints (``GRPO_TOOL_ENDPOINTS``, :mod:`app.core.tool_endpoints`, which
says the protocol), passed to ``train()`` as ``http_tools``/``http_environment``.

- :class:`HttpToolClient` is the trainer's :class:`~trainer.agents.HttpTools`: a turn's calls of
  one tool go out together (at most ``GRPO_TOOL_CONCURRENCY`` in flight), each within the job's
  ``episode.tool_timeout_s``.
- :class:`HttpEnvironment` is an :class:`~trainer.agents.Environment`: reset/step of a turn's
  live episodes go out together the same way.

Neither raises for what an endpoint does: a timeout, a failed connection, a status other than
2xx, an answer over ``GRPO_TOOL_MAX_RESPONSE_BYTES`` or one that is not the protocol's is a tool
error result (whose text the model reads) or an :class:`~trainer.agents.EnvStep` with ``error``
(the episode ends with reason error). Their messages never carry the endpoint's URL: the model,
and the job's owner through its samples, read them. URLs come only from the operator's
registry; redirects are not followed and the worker's proxy variables are not used.

This module imports the trainer's agent types (torch): the runner imports it only for a job
that names endpoints (:func:`http_agents`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import httpx

from app.core.tool_endpoints import (
    ToolEndpoint,
    ToolEndpointSettings,
    build_tool_endpoint_settings,
)
from jobspec import HttpEnvironment as HttpEnvironmentSpec
from jobspec import JobSpec
from trainer.agents.environment import EnvStep, env_step_from_json
from trainer.agents.tools import MAX_RESULT_CHARS, ToolResult
from trainer.errors import TrainerError

__all__ = ["EndpointFailure", "HttpEnvironment", "HttpToolClient", "http_agents"]

T = TypeVar("T")


class EndpointFailure(Exception):
    """Why a call got no usable answer, in words fit for the model and the job's owner."""


async def post_json(
    client: httpx.AsyncClient,
    endpoint: ToolEndpoint,
    path: str,
    body: Mapping[str, Any],
    *,
    timeout_s: float,
    max_bytes: int,
) -> Any:
    """POST ``body`` to ``endpoint.url + path``; its JSON answer, read within ``timeout_s``
    (all of it: connecting, sending, every chunk) and at most ``max_bytes`` long."""
    content = json.dumps(body, default=str).encode()
    headers = {"Content-Type": "application/json"}
    if (key := endpoint.api_key()) is not None:
        headers["Authorization"] = f"Bearer {key}"

    async def exchange() -> bytes:
        request = client.build_request(
            "POST", endpoint.url + path, content=content, headers=headers
        )
        response = await client.send(request, stream=True)
        try:
            if not 200 <= response.status_code < 300:
                raise EndpointFailure(f"the endpoint answered HTTP {response.status_code}")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise EndpointFailure(f"the endpoint's answer is over {max_bytes} bytes")
            chunks, size = [], 0
            async for chunk in response.aiter_raw():
                size += len(chunk)
                if size > max_bytes:
                    raise EndpointFailure(f"the endpoint's answer is over {max_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            await response.aclose()

    try:
        raw = await asyncio.wait_for(exchange(), timeout_s)
    except TimeoutError:
        raise EndpointFailure(f"the endpoint gave no answer within {timeout_s:g} s") from None
    except httpx.HTTPError as exc:  # its message may name the URL: only the kind goes on
        raise EndpointFailure(f"the call failed ({type(exc).__name__})") from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise EndpointFailure("the endpoint's answer is not JSON") from None


def run_calls(
    calls: Sequence[Callable[[httpx.AsyncClient], Awaitable[T]]], concurrency: int
) -> list[T]:
    """Run ``calls`` on one client, at most ``concurrency`` at once; their results in order."""

    async def all_of() -> list[T]:
        gate = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency)
        # trust_env=False: the worker's proxy variables must not reroute a call (nor a
        # .netrc add credentials to it).
        async with httpx.AsyncClient(
            limits=limits, follow_redirects=False, trust_env=False, timeout=None
        ) as client:

            async def one(call: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
                async with gate:
                    return await call(client)

            return await asyncio.gather(*(one(c) for c in calls))

    return asyncio.run(all_of()) if calls else []


def _failed(why: str) -> ToolResult:
    return ToolResult(f"error: {why}"[:MAX_RESULT_CHARS], error=why[:MAX_RESULT_CHARS])


def tool_result(answer: Any) -> ToolResult:
    """A tool endpoint's JSON answer as what the model reads: ``{"content": ...}`` (a string,
    or any JSON shown as JSON) or ``{"error": "..."}``; anything else is an error."""
    if isinstance(answer, dict) and "content" in answer and answer.get("error") is None:
        content = answer["content"]
        if not isinstance(content, str):
            content = json.dumps(content, separators=(",", ":"))
        return ToolResult(content[:MAX_RESULT_CHARS])
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return _failed(answer["error"])
    return _failed('the endpoint\'s answer is neither {"content": ...} nor {"error": "..."}')


class HttpToolClient:
    """The trainer's ``HttpTools`` on the operator's endpoints (see the module docstring)."""

    def __init__(self, settings: ToolEndpointSettings | None = None) -> None:
        self.settings = settings or build_tool_endpoint_settings()

    def call(
        self,
        endpoint: str,
        name: str,
        arguments: Sequence[Mapping[str, Any]],
        *,
        timeout_s: float,
    ) -> list[ToolResult]:
        target = self.settings.endpoints.get(endpoint)
        if target is None:
            return [_failed(f"tool endpoint {endpoint!r} is not configured")] * len(arguments)
        max_bytes = self.settings.max_response_bytes

        def call_with(args: Mapping[str, Any]) -> Callable[[httpx.AsyncClient], Awaitable[Any]]:
            async def call(client: httpx.AsyncClient) -> ToolResult:
                body = {"name": name, "arguments": dict(args)}
                try:
                    answer = await post_json(
                        client, target, "", body, timeout_s=timeout_s, max_bytes=max_bytes
                    )
                except EndpointFailure as exc:
                    return _failed(str(exc))
                return tool_result(answer)

            return call

        return run_calls([call_with(a) for a in arguments], self.settings.concurrency)


class HttpEnvironment:
    """An ``Environment`` on the operator's endpoint (``environment: {type: http}``): POST
    ``/reset`` and ``/step`` with an episode id (see the module docstring)."""

    def __init__(
        self,
        endpoint: ToolEndpoint,
        *,
        timeout_s: float,
        settings: ToolEndpointSettings | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.settings = settings or build_tool_endpoint_settings()

    def _calls(self, op: str, bodies: Sequence[dict[str, Any]]) -> list[EnvStep]:
        max_bytes = self.settings.max_response_bytes

        def call_with(body: dict[str, Any]) -> Callable[[httpx.AsyncClient], Awaitable[Any]]:
            async def call(client: httpx.AsyncClient) -> EnvStep:
                try:
                    answer = await post_json(
                        client,
                        self.endpoint,
                        f"/{op}",
                        body,
                        timeout_s=self.timeout_s,
                        max_bytes=max_bytes,
                    )
                except EndpointFailure as exc:
                    return EnvStep(error=str(exc)[:300])
                return env_step_from_json(json.dumps(answer), reset=op == "reset")

            return call

        return run_calls([call_with(b) for b in bodies], self.settings.concurrency)

    def reset(
        self, episode_ids: Sequence[str], items: Sequence[Mapping[str, Any]]
    ) -> list[EnvStep]:
        bodies = [
            {"episode_id": e, "item": dict(i)} for e, i in zip(episode_ids, items, strict=True)
        ]
        return self._calls("reset", bodies)

    def step(
        self, episode_ids: Sequence[str], messages: Sequence[Sequence[Mapping[str, Any]]]
    ) -> list[EnvStep]:
        bodies = [
            {"episode_id": e, "messages": [dict(m) for m in ms]}
            for e, ms in zip(episode_ids, messages, strict=True)
        ]
        return self._calls("step", bodies)

    def close(self) -> None:
        return None


def http_agents(
    spec: JobSpec, settings: ToolEndpointSettings | None = None
) -> dict[str, HttpToolClient | HttpEnvironment]:
    """``train()``'s ``http_tools``/``http_environment`` for ``spec`` (only those it needs).

    An endpoint the job names that this worker's registry lacks (the API admitted it from its
    own) fails the job now, reason ``agent_endpoint_missing``: the operator's settings of the API
    and the workers disagree."""
    settings = settings or build_tool_endpoint_settings()
    for where, name in spec.agent_endpoints:
        if name not in settings.endpoints:
            raise TrainerError(
                f"{where}: endpoint {name!r} is not configured on this worker "
                "(GRPO_TOOL_ENDPOINTS; the operator sets it on the API and the workers alike)",
                reason="agent_endpoint_missing",
            )
    out: dict[str, HttpToolClient | HttpEnvironment] = {}
    if any(where.startswith("tools[") for where, _ in spec.agent_endpoints):
        out["http_tools"] = HttpToolClient(settings)
    env = spec.environment
    if isinstance(env, HttpEnvironmentSpec):
        out["http_environment"] = HttpEnvironment(
            settings.endpoints[env.endpoint],
            timeout_s=spec.episode.tool_timeout_s,
            settings=settings,
        )
    return out
