"""A chat request to a model trained here, written as its training wrote prompts, and the tool
calls of its answer in OpenAI's shape, so that an agent trained here is called as an agent
(docs/openai-compat.md, "Calling an agent trained here").

The rules are the trainer's, declared once in jobspec.prompt_format; this module maps
OpenAI's request and answer shapes onto them, with the job's prompt settings
(:class:`TrainedPrompt`, from its spec) and the template's
:class:`~jobspec.prompt_format.TemplateTraits` (probed where the tokenizer is):

- :func:`render_messages`: an assistant turn's ``tool_calls`` become Hermes call text after its
  content (in training the model's turn is the text it sampled); a ``tool`` turn becomes the
  tool result as the template takes it (a ``tool`` turn, or a prefixed user turn), named after
  the call it answers; then the job's system prompt and few-shot turns go where training put
  them (a conversation's own system turn wins, as a row's did). The request's ``tools`` reach a
  template that renders them through it (kept, with ``tool_choice: "none"``: vLLM renders them
  and leaves the parsing here); any other template reads them in the default tool prompt at the
  head of the system turn, and ``tools`` is dropped. Either way each tool is written in the
  shape a job's tools had (:func:`trained_tools`: the spec's ToolFunction and its defaults).
- :func:`with_tool_calls`: each choice's content is read by the family's parser; its calls
  become ``tool_calls`` (``call_...`` ids, arguments as JSON text) and the choice's
  ``finish_reason`` ``tool_calls``; the text around them stays the content (None when empty).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jobspec.agents import ToolFunction
from jobspec.prompt_format import (
    TOOL_CALL_PARSERS,
    TemplateTraits,
    conversation,
    hermes_call_text,
    tool_result_message,
    with_tool_prompt,
)

Message = dict[str, Any]
UNKNOWN_TOOL = "tool"  # the name of a result whose call is not in the conversation


@dataclass(frozen=True)
class TrainedPrompt:
    """What a job's rollouts put around a row's conversation (its spec's ``dataset``)."""

    system_prompt: str | None = None
    few_shot: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def of_spec(cls, spec: Mapping[str, Any]) -> TrainedPrompt:
        dataset = spec.get("dataset") or {}
        few_shot = tuple(dict(m) for m in dataset.get("few_shot") or ())
        return cls(dataset.get("system_prompt") or None, few_shot)


def _text(content: Any) -> str:
    """A message's content as text (OpenAI's list of text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))


def _call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function") or {}
    raw = function.get("arguments") or "{}"
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        arguments = {}
    return hermes_call_text(str(function.get("name", "")), arguments or {})


def _plain_turns(messages: Sequence[Mapping[str, Any]], traits: TemplateTraits) -> list[Message]:
    """The client's turns as training wrote them: tool calls as text, results as results."""
    names: dict[str, str] = {}  # call id -> tool name
    out: list[Message] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            calls = message.get("tool_calls") or []
            for call in calls:
                names[str(call.get("id", ""))] = str((call.get("function") or {}).get("name"))
            parts = [_text(message.get("content")), *(_call_text(c) for c in calls)]
            out.append({"role": "assistant", "content": "\n".join(p for p in parts if p)})
        elif role == "tool":
            name = message.get("name") or names.get(str(message.get("tool_call_id")), UNKNOWN_TOOL)
            content = _text(message.get("content"))
            out.append(tool_result_message(str(name), content, tool_role=traits.tool_role))
        else:
            out.append({"role": role, "content": _text(message.get("content"))})
    return out


def trained_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI function tools in the shape a job's tools had in training (the spec's
    ToolFunction with its defaults: a description, an object schema); ValueError (pydantic's)
    for a tool a job could not have declared."""
    return [
        {
            "type": "function",
            "function": ToolFunction.model_validate(t.get("function") or {}).model_dump(
                exclude_none=True
            ),
        }
        for t in tools
    ]


def render_messages(
    body: Mapping[str, Any], prompt: TrainedPrompt, traits: TemplateTraits
) -> dict[str, Any]:
    """The chat body to send the engine: ``body`` with its messages (and tools) written as the
    job's training wrote them (see the module docstring)."""
    out = dict(body)
    turns = _plain_turns(body.get("messages") or [], traits)
    messages = conversation(turns, system_prompt=prompt.system_prompt, few_shot=prompt.few_shot)
    tools = trained_tools(body.get("tools") or [])
    if tools and not traits.native_tools:
        messages = with_tool_prompt(messages, tools)
        out.pop("tools", None)
        out.pop("tool_choice", None)
    elif tools:
        out["tools"] = tools
        out["tool_choice"] = "none"  # vLLM renders them; the calls are read here
    out["messages"] = messages
    return out


def _openai_call(name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(dict(arguments), ensure_ascii=False)},
    }


def with_tool_calls(answer: dict[str, Any], traits: TemplateTraits) -> dict[str, Any]:
    """``answer`` (a chat.completion) with each choice's tool calls read out of its content."""
    parse = TOOL_CALL_PARSERS[traits.family]
    for choice in answer.get("choices") or []:
        message = choice.get("message") or {}
        content = message.get("content")
        if not isinstance(content, str):
            continue
        turn = parse(content)
        if not turn.calls:
            continue
        message["content"] = turn.content or None
        message["tool_calls"] = [_openai_call(c.name, c.arguments) for c in turn.calls]
        choice["finish_reason"] = "tool_calls"
    return answer
