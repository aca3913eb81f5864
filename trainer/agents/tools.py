"""The job's tools, run a turn's calls at a time: python tools in the grader sandbox
(:class:`~grading.sandbox.SandboxPool` in call mode, one pool per tool, with the sandbox's
limits and ``episode.tool_timeout_s`` per call), http tools through an :class:`HttpTools` the
worker provides (the operator's registered endpoints; the trainer never sees an address).

A tool's failure (it raised, overran, was killed, its endpoint failed, it is unknown) is a
:class:`ToolResult` with ``error`` set, whose text the model reads as the result: it never
raises out of :meth:`Toolbox.run`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from grading.sandbox import SandboxError, SandboxPool, SandboxSettings, build_sandbox_settings
from jobspec import HttpToolImplementation, PythonToolImplementation, ToolSpec
from trainer.agents.parsing import ToolCall

__all__ = ["MAX_RESULT_CHARS", "HttpTools", "ToolResult", "ToolRunner", "Toolbox"]

MAX_RESULT_CHARS = 8_000  # of one result the model reads (the episode's token budget bounds more)


@dataclass(frozen=True)
class ToolResult:
    """What the model reads back, and why the call failed (None: it did not)."""

    content: str
    error: str | None = None


class ToolRunner(Protocol):
    """What the driver runs a turn's calls with (:class:`Toolbox`, or a test's stand-in)."""

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in order; never raises for what a tool does."""
        ...


class HttpTools(Protocol):
    """Calls of the operator's tool endpoints (the worker implements it from its settings).

    ``call(endpoint, name, arguments)`` runs ``name`` once per ``arguments`` on the endpoint
    the operator registered as ``endpoint``, each within ``timeout_s``, and returns one result
    per call in order; it must not raise for what the endpoint does."""

    def call(
        self,
        endpoint: str,
        name: str,
        arguments: Sequence[Mapping[str, Any]],
        *,
        timeout_s: float,
    ) -> list[ToolResult]: ...


def _failed(why: str) -> ToolResult:
    return ToolResult(f"error: {why}"[:MAX_RESULT_CHARS], error=why)


class Toolbox:
    """The job's tools by name (see the module docstring)."""

    def __init__(
        self,
        tools: Sequence[ToolSpec],
        *,
        timeout_s: float,
        sandbox_settings: SandboxSettings | None = None,
        http: HttpTools | None = None,
    ) -> None:
        self.specs = {t.function.name: t for t in tools}
        self.timeout_s = timeout_s
        settings = sandbox_settings or build_sandbox_settings()
        # The job's limit, within the operator's: a tool call never outlives the sandbox's own.
        self._settings = settings.model_copy(
            update={"call_timeout_s": min(settings.call_timeout_s, timeout_s)}
        )
        self._http = http
        self._pools: dict[str, SandboxPool] = {}

    def schemas(self) -> list[dict[str, Any]]:
        """The tools as OpenAI function-tool dicts (what chat templates take as ``tools=``)."""
        return [
            {"type": "function", "function": t.function.model_dump(exclude_none=True)}
            for t in self.specs.values()
        ]

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in order; the calls of each tool go out as one batch."""
        results: list[ToolResult | None] = [None] * len(calls)
        by_tool: dict[str, list[int]] = defaultdict(list)
        for i, call in enumerate(calls):
            if call.name in self.specs:
                by_tool[call.name].append(i)
            else:
                results[i] = _failed(f"unknown tool {call.name!r:.80}")
        for name, indexes in by_tool.items():
            arguments = [calls[i].arguments for i in indexes]
            for i, result in zip(indexes, self._run_tool(name, arguments), strict=True):
                results[i] = result
        return [r if r is not None else _failed("no result") for r in results]

    def _run_tool(self, name: str, arguments: list[dict[str, Any]]) -> list[ToolResult]:
        impl = self.specs[name].implementation
        if isinstance(impl, HttpToolImplementation):
            if self._http is None:
                return [_failed("http tools are not available here")] * len(arguments)
            return self._http.call(impl.endpoint, name, arguments, timeout_s=self.timeout_s)
        assert isinstance(impl, PythonToolImplementation)
        try:
            pool = self._pools.get(name)
            if pool is None:
                pool = self._pools[name] = SandboxPool(impl.source, self._settings, call=name)
            verdicts = pool.call_tool(arguments)
        except SandboxError as exc:  # no sandbox here, or the source does not load
            return [_failed(str(exc))] * len(arguments)
        out = []
        for verdict in verdicts:
            if verdict.failure is not None or verdict.value is None:
                out.append(_failed(verdict.error or verdict.failure or "no result"))
            else:
                out.append(ToolResult(verdict.value[:MAX_RESULT_CHARS]))
        return out

    def close(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.close()
