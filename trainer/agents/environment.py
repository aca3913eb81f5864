"""Environments an episode steps through, called for all live episodes of a turn at once.

The protocol (OpenAI's python grader conventions for what runs in the sandbox; TRL, SkyRL and
Tinker have the same shape): ``reset(item) -> messages`` starts an episode (its messages follow
the row's own), ``step(messages) -> {messages, reward, done}`` answers an assistant turn that
called no tool. :class:`Environment` is the batched interface the driver uses; the worker
provides the http one (``{type: http, endpoint}``: POST reset/step with an episode id to the
operator's endpoint), and :class:`SandboxEnvironment` runs a python class in the grader sandbox.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from grading.sandbox import SandboxError, SandboxPool, SandboxSettings, build_sandbox_settings

__all__ = ["EnvStep", "Environment", "SandboxEnvironment", "env_step_from_json"]

MAX_ENV_MESSAGES = 16
_ROLES = frozenset({"user", "system", "tool"})


@dataclass(frozen=True)
class EnvStep:
    """One environment answer: messages to inject, its reward (None: none given), whether the
    episode is over, and why it failed (``error`` set: the episode ends with reason error)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    error: str | None = None


class Environment(Protocol):
    def reset(
        self, episode_ids: Sequence[str], items: Sequence[Mapping[str, Any]]
    ) -> list[EnvStep]:
        """Start one episode per id; each answer's ``messages`` open its conversation."""
        ...

    def step(
        self, episode_ids: Sequence[str], messages: Sequence[Sequence[Mapping[str, Any]]]
    ) -> list[EnvStep]:
        """Answer each live episode's latest assistant turn (``messages[i]``: that turn)."""
        ...

    def close(self) -> None: ...


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or len(value) > MAX_ENV_MESSAGES:
        raise ValueError(f"messages must be a list of at most {MAX_ENV_MESSAGES} messages")
    out = []
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ValueError("each message is {role: user|system|tool, content: str}")
        if not isinstance(m.get("content"), str):
            raise ValueError("each message's content is a string")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def env_step_from_json(text: str, *, reset: bool) -> EnvStep:
    """An environment's JSON answer read: ``reset`` answers a list of messages, ``step`` an
    object ``{messages, reward, done}``. Anything else is an :class:`EnvStep` with ``error``."""
    try:
        value = json.loads(text)
        if reset:
            return EnvStep(messages=_messages(value))
        if not isinstance(value, dict):
            raise ValueError("step must return {messages, reward, done}")
        reward = value.get("reward")
        if reward is not None and (
            isinstance(reward, bool)
            or not isinstance(reward, int | float)
            or not math.isfinite(reward)
        ):
            raise ValueError("reward must be a finite number")
        return EnvStep(
            messages=_messages(value.get("messages", [])),
            reward=None if reward is None else float(reward),
            done=bool(value.get("done", False)),
        )
    except (ValueError, RecursionError) as exc:
        return EnvStep(error=str(exc)[:300])


# Appended to the user's source: one instance per episode, kept in the sandbox's process.
_DISPATCH = """

_grpo_episodes = {}


def _grpo_env_call(op, episode, payload):
    if op == "reset":
        _grpo_episodes[episode] = %s()
        return _grpo_episodes[episode].reset(payload)
    out = _grpo_episodes[episode].step(payload)
    if isinstance(out, dict) and out.get("done"):
        _grpo_episodes.pop(episode, None)
    return out
"""


class SandboxEnvironment:
    """A python environment class (``environment: {type: python}``) in one grader sandbox.

    Its instances live in that sandbox's process, so it is one sandbox (calls run one after
    another); a call that overruns or kills the sandbox loses every episode's instance, and
    those episodes end with reason error on their next call."""

    def __init__(
        self, source: str, class_name: str, *, timeout_s: float, settings: SandboxSettings | None
    ) -> None:
        base = settings or build_sandbox_settings()
        self._settings = base.model_copy(
            update={"processes": 1, "call_timeout_s": min(base.call_timeout_s, timeout_s)}
        )
        self._source = source + _DISPATCH % class_name
        self._pool: SandboxPool | None = None

    def _call(self, op: str, ids: Sequence[str], payloads: Sequence[Any]) -> list[EnvStep]:
        args = [{"op": op, "episode": e, "payload": p} for e, p in zip(ids, payloads, strict=True)]
        try:
            if self._pool is None:
                self._pool = SandboxPool(self._source, self._settings, call="_grpo_env_call")
            verdicts = self._pool.call_tool(args)
        except SandboxError as exc:
            return [EnvStep(error=str(exc)[:300]) for _ in args]
        return [
            env_step_from_json(v.value, reset=op == "reset")
            if v.value is not None and v.failure is None
            else EnvStep(error=v.error or v.failure or "no answer")
            for v in verdicts
        ]

    def reset(
        self, episode_ids: Sequence[str], items: Sequence[Mapping[str, Any]]
    ) -> list[EnvStep]:
        return self._call("reset", episode_ids, [dict(i) for i in items])

    def step(
        self, episode_ids: Sequence[str], messages: Sequence[Sequence[Mapping[str, Any]]]
    ) -> list[EnvStep]:
        return self._call("step", episode_ids, [[dict(m) for m in ms] for ms in messages])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
