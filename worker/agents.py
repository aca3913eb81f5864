"""The worker's side of agent jobs: http tools and http environments on the
operator's registered endpoints (``GRPO_TOOL_ENDPOINTS``, :mod:`grading.endpoints`, which says
the protocol), passed to ``train()`` as ``http_tools``/``http_environment``.

- :class:`HttpToolClient` is the trainer's :class:`~trainer.agents.HttpTools`: a turn's calls of
  one tool go out together (at most ``GRPO_TOOL_CONCURRENCY`` in flight), each within the job's
  ``episode.tool_timeout_s``.
- :class:`HttpEnvironmentClient` is an :class:`~trainer.agents.Environment` (the runtime of the
  spec's ``environment: {type: http}``, :class:`jobspec.HttpEnvironment`): reset/step of a
  turn's live episodes go out together the same way.

Both call through the endpoints' one bounded client (:func:`grading.endpoints.run_calls`:
no redirects, no proxy variables, bounded time and size). Neither raises for what an endpoint
does: a timeout, a failed connection, a status other than 2xx, an answer over
``GRPO_TOOL_MAX_RESPONSE_BYTES`` or one that is not the protocol's is a tool error result (whose
text the model reads) or an :class:`~trainer.agents.EnvStep` with ``error`` (the episode ends
with reason error). Their messages never carry the endpoint's URL: the model, and the job's
owner through its samples, read them.

This module imports the trainer's agent types (torch): the runner imports it only for a job
that names endpoints (:func:`http_agents`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from grading.endpoints import (
    EndpointCalls,
    EndpointFailure,
    ToolEndpoint,
    ToolEndpointSettings,
    build_tool_endpoint_settings,
    run_calls,
)
from jobspec import HttpEnvironment, JobSpec
from trainer.agents.environment import EnvStep, env_step_from_json
from trainer.agents.tools import MAX_RESULT_CHARS, ToolResult
from trainer.errors import TrainerError

__all__ = ["HttpEnvironmentClient", "HttpToolClient", "http_agents"]


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

        def call_with(args: Mapping[str, Any]) -> Callable[[EndpointCalls], Awaitable[ToolResult]]:
            async def call(calls: EndpointCalls) -> ToolResult:
                body = {"name": name, "arguments": dict(args)}
                try:
                    answer = await calls.post_json(
                        target, "", body, timeout_s=timeout_s, max_bytes=max_bytes
                    )
                except EndpointFailure as exc:
                    return _failed(str(exc))
                return tool_result(answer)

            return call

        return run_calls([call_with(a) for a in arguments], self.settings.concurrency)


class HttpEnvironmentClient:
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

        def call_with(body: dict[str, Any]) -> Callable[[EndpointCalls], Awaitable[EnvStep]]:
            async def call(calls: EndpointCalls) -> EnvStep:
                try:
                    answer = await calls.post_json(
                        self.endpoint, f"/{op}", body, timeout_s=self.timeout_s, max_bytes=max_bytes
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
) -> dict[str, HttpToolClient | HttpEnvironmentClient]:
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
    out: dict[str, HttpToolClient | HttpEnvironmentClient] = {}
    if any(where.startswith("tools[") for where, _ in spec.agent_endpoints):
        out["http_tools"] = HttpToolClient(settings)
    env = spec.environment
    if isinstance(env, HttpEnvironment):
        out["http_environment"] = HttpEnvironmentClient(
            settings.endpoints[env.endpoint],
            timeout_s=spec.episode.tool_timeout_s,
            settings=settings,
        )
    return out
