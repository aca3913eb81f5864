"""Agent RFT requests as native agent jobs: the part of app.fine_tuning.service's mapping that
concerns tools, environments and episodes (docs/openai-compat.md, "Agent RFT: tools").

- method.reinforcement.tools (OpenAI's function tools, either shape) -> tools, each with the
  implementation grpo_service.tool_implementations gives under its name (``{type: http,
  endpoint: NAME}``, an operator endpoint, or ``{type: python, source}``). OpenAI's hosted tools
  call the caller's URL; this service calls none a job gives, so a tool's ``url``,
  ``server_url`` or ``headers`` is a 400 naming it (app.fine_tuning.schemas.RftTool), and so is a
  tool without an implementation or an implementation of no tool;
- method.reinforcement.max_episode_steps -> episode.max_turns;
- grpo_service.environment, grpo_service.episode -> the native sections as they are.
"""

from __future__ import annotations

from typing import Any

from app.core.errors import InvalidRequest
from app.fine_tuning.schemas import FineTuningJobCreate

TOOLS = "method.reinforcement.tools"
IMPLEMENTATIONS = "grpo_service.tool_implementations"


def _native_tools(request: FineTuningJobCreate, sources: dict[str, str]) -> list[dict[str, Any]]:
    assert request.method is not None and request.method.reinforcement is not None
    ext = request.grpo_service
    implementations = dict(ext.tool_implementations or {}) if ext else {}
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(request.method.reinforcement.tools or []):
        where = f"{TOOLS}[{i}]"
        flat = (tool.name, tool.description, tool.parameters, tool.strict)
        if tool.function is not None and any(v is not None for v in flat):
            raise InvalidRequest(
                f"{where}: give the function tool as {{function: {{name, ...}}}} or with its "
                "fields flat ({name, description, parameters}), not both",
                param=where,
            )
        name = tool.tool_name
        if name is None:
            raise InvalidRequest(f"{where}: a function tool needs a name", param=f"{where}.name")
        implementation = implementations.get(name)
        if implementation is None:
            raise InvalidRequest(
                f"tool {name!r} says nothing of how it runs: give {IMPLEMENTATIONS}.{name} "
                "({type: http, endpoint: NAME}, an endpoint of this service's operator, or "
                "{type: python, source})",
                param=where,
            )
        tools.append(
            {
                "type": "function",
                "function": tool.native_function(),
                "implementation": implementation.model_dump(mode="json"),
            }
        )
        sources[f"tools[{i}]"] = where
        sources[f"tools[{i}].function"] = f"{where}.function" if tool.function else where
        sources[f"tools[{i}].implementation"] = f"{IMPLEMENTATIONS}.{name}"
    named = {t["function"].get("name") for t in tools}
    for name in implementations:
        if name not in named:
            raise InvalidRequest(
                f"{IMPLEMENTATIONS}.{name}: no tool of {TOOLS} is named {name!r}",
                param=f"{IMPLEMENTATIONS}.{name}",
            )
    return tools


def add_agents(
    request: FineTuningJobCreate, *, native: dict[str, Any], sources: dict[str, str]
) -> None:
    """The request's tools, environment and episode budgets into the translated spec
    (``native``), each recorded in ``sources`` (see the module docstring)."""
    assert request.method is not None and request.method.reinforcement is not None
    rft = request.method.reinforcement
    ext = request.grpo_service
    tools = _native_tools(request, sources)
    if tools:
        native["tools"] = tools
        sources["tools"] = TOOLS
    episode = dict(ext.episode or {}) if ext else {}
    if rft.max_episode_steps is not None:
        if "max_turns" in episode:
            raise InvalidRequest(
                "method.reinforcement.max_episode_steps and grpo_service.episode.max_turns both "
                "set episode.max_turns; give one",
                param="grpo_service.episode.max_turns",
            )
        episode["max_turns"] = rft.max_episode_steps
        sources["episode.max_turns"] = "method.reinforcement.max_episode_steps"
    if episode:
        native["episode"] = episode
    if ext is not None and ext.environment is not None:
        native["environment"] = ext.environment
