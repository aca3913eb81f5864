"""How a job's conversations and tool calls are written for the model, declared once for the
trainer's rollouts and for the served model, so that an agent trained here is called as an
agent. Plain text and dicts, no tokenizer: the API imports it, and the chat template itself is
applied by whoever holds the tokenizer (the trainer, or the vLLM server).

- :func:`conversation`: a row's system turn (its own, else the job's ``system_prompt``), the
  job's ``few_shot`` turns, then the rest of the conversation.
- Tools reach a model whose chat template renders ``tools=`` through it; any other model reads
  :func:`default_tool_prompt` at the head of its system turn (:func:`with_tool_prompt`), and
  answers in the Hermes format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (:func:`hermes_call_text`). A tool's result is a ``tool`` turn where the template renders one,
  else a user turn that starts with :data:`TOOL_RESULT_PREFIX` (:func:`tool_result_message`).
- :class:`TemplateTraits` is what decides between them for one tokenizer; the trainer probes the
  template for them (trainer.agents.chat.chat_format).
- :func:`parse_hermes` reads the calls back out of an assistant turn, never raising on what the
  model wrote (a call it cannot read is a ``malformed`` reason), in one pass over the text.
- :func:`clean_text` / :func:`clean_json`: lone surrogates (JSON can carry one, UTF-8 cannot)
  replaced with U+FFFD, in text from outside the model (trainer.agents.outside) and in the
  model's call arguments (a JSON escape can make one).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

__all__ = [
    "DEFAULT_FAMILY",
    "MAX_CALLS_PER_TURN",
    "TOOL_CALL_PARSERS",
    "TOOL_RESULT_PREFIX",
    "Message",
    "ParsedTurn",
    "TemplateTraits",
    "ToolCall",
    "clean_json",
    "clean_text",
    "conversation",
    "default_tool_prompt",
    "hermes_call_text",
    "parse_hermes",
    "template_family",
    "tool_result_message",
    "with_tool_prompt",
]

Message = dict[str, Any]
TOOL_RESULT_PREFIX = "Tool result"
MAX_CALLS_PER_TURN = 16
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """``text`` with every lone surrogate replaced with U+FFFD (a Python string holds a pair
    as one character, so any surrogate in it is a lone one)."""
    return _SURROGATE.sub("\ufffd", text)


def clean_json(value: Any) -> Any:
    """A parsed JSON value with the lone surrogates of its strings (keys too) replaced."""
    text = json.dumps(value, ensure_ascii=False)
    if _SURROGATE.search(text) is None:
        return value
    # A surrogate can only sit inside a string literal: replacing it keeps the JSON valid.
    return json.loads(clean_text(text))


def conversation(
    prompt: str | Sequence[Mapping[str, Any]],
    *,
    system_prompt: str | None,
    few_shot: Sequence[Mapping[str, Any]] = (),
) -> list[Message]:
    """The messages a prompt (or a conversation ending with a user turn) is sent as: the system
    turn (the conversation's own, else ``system_prompt``), then the ``few_shot`` example turns,
    then the rest of the conversation. Fresh dicts: callers may edit them."""
    if isinstance(prompt, str):
        messages: list[Message] = [{"role": "user", "content": prompt}]
    else:
        messages = [dict(m) for m in prompt]
    own_system = bool(messages) and messages[0].get("role") == "system"
    system = messages[:1] if own_system else []
    if not system and system_prompt:
        system = [{"role": "system", "content": system_prompt}]
    rest = messages[1:] if own_system else messages
    return [*system, *(dict(m) for m in few_shot), *rest]


def default_tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system-turn text that describes ``tools`` (OpenAI function-tool dicts) and the call
    format to a model whose template has no tool support."""
    schemas = "\n".join(json.dumps(dict(t["function"]), sort_keys=True) for t in tools)
    return (
        "You can call tools. To call one, write on its own line\n"
        '<tool_call>{"name": "<tool name>", "arguments": {<the arguments as JSON>}}</tool_call>\n'
        "and stop; its result comes back in the next message. Available tools:\n"
        f"{schemas}"
    )


def with_tool_prompt(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[Message]:
    """``messages`` with :func:`default_tool_prompt` at the head of the system turn (a
    conversation's own system text kept after it), or in a system turn of its own."""
    out = [dict(m) for m in messages]
    if not tools:
        return out
    prompt = default_tool_prompt(tools)
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{prompt}\n\n{out[0].get('content', '')}"
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def tool_result_message(name: str, content: str, *, tool_role: bool) -> Message:
    """A tool's result as the template takes it: a ``tool`` turn, or a prefixed user turn."""
    if tool_role:
        return {"role": "tool", "name": name, "content": content}
    return {"role": "user", "content": f"{TOOL_RESULT_PREFIX} ({name}):\n{content}"}


def hermes_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """One call as the Hermes format writes it (what the default tool prompt asks for)."""
    body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"{_OPEN}{body}{_CLOSE}"


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: a tool name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn read: its text without the calls, the calls, and why any call could
    not be read (one reason per malformed call)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)


def _hermes_call(body: str) -> ToolCall | str:
    """The call in one ``<tool_call>`` body, or why it is malformed."""
    try:
        value = json.loads(body.strip())
    except (ValueError, RecursionError) as exc:
        return f"not JSON: {str(exc)[:120]}"
    if not isinstance(value, dict):
        return "not a JSON object"
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return "no tool name"
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return "arguments are not a JSON object"
    if not isinstance(arguments, dict):
        return "arguments are not a JSON object"
    # A JSON escape can make a lone surrogate, which no tool, transcript or store can take.
    return ToolCall(clean_text(name), clean_json(arguments))


def parse_hermes(text: str) -> ParsedTurn:
    """``<tool_call>{json}</tool_call>`` blocks, anywhere in ``text``; an opening tag left
    unclosed is a malformed call (the turn ran out of tokens mid-call, or the model forgot it)
    and ends the content there. One left-to-right pass: each tag is looked for once, from where
    the previous block ended, so a text of many unclosed tags costs no more than its length (a
    lazy pattern rescans the rest of the text from every opening tag: quadratic)."""
    calls: list[ToolCall] = []
    malformed: list[str] = []
    kept: list[str] = []
    at = 0
    while (start := text.find(_OPEN, at)) >= 0:
        kept.append(text[at:start])
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            malformed.append(f"{_OPEN} not closed")
            at = len(text)
            break
        parsed = _hermes_call(text[start + len(_OPEN) : end])
        if isinstance(parsed, str):
            malformed.append(parsed)
        elif len(calls) < MAX_CALLS_PER_TURN:
            calls.append(parsed)
        else:
            malformed.append(f"more than {MAX_CALLS_PER_TURN} calls in one turn")
        at = end + len(_CLOSE)
    kept.append(text[at:])
    return ParsedTurn("".join(kept).strip(), calls, malformed)


TOOL_CALL_PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}
DEFAULT_FAMILY = "hermes"  # the format the default tool prompt teaches
# What a chat template writes that names its family's format (first match wins).
_FAMILY_MARKERS: tuple[tuple[str, str], ...] = ((_OPEN, "hermes"),)


def template_family(template: str | None) -> str:
    """The tool-call format of a chat template's model family; a template with no tool format
    of its own (SmolLM2's) gets :data:`DEFAULT_FAMILY`, the format the default prompt asks for."""
    if isinstance(template, str):
        for marker, family in _FAMILY_MARKERS:
            if marker in template:
                return family
    return DEFAULT_FAMILY


class TemplateTraits(BaseModel):
    """One tokenizer's way with tools (trainer.agents.chat probes its chat template): whether
    the template renders ``tools=`` (else the default tool prompt goes in the system turn),
    whether it renders a ``tool`` turn (else a prefixed user turn), and its call format."""

    native_tools: bool
    tool_role: bool
    family: str = DEFAULT_FAMILY
