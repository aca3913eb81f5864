"""Tool calls out of an assistant turn's text, by the model family's format.

A parser never raises on what the model wrote: a call it cannot read is returned as a
``malformed`` reason (an episode event, counted in ``tools/malformed``), and the text around
the calls is the turn's content.

Families (:data:`TOOL_CALL_PARSERS`): ``hermes``, ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` (Hermes, Qwen2.5/Qwen3, and our default format for templates without tool
support, SmolLM2's included). Adding one: a function here, an entry in the registry, and a rule
in :func:`parser_family`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from trainer.agents.outside import clean_json, clean_text

__all__ = [
    "DEFAULT_FAMILY",
    "TOOL_CALL_PARSERS",
    "ParsedTurn",
    "ToolCall",
    "parse_hermes",
    "parser_family",
]

MAX_CALLS_PER_TURN = 16


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


_OPEN_TAG, _CLOSE_TAG = "<tool_call>", "</tool_call>"


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
    unclosed is a malformed call (the turn ran out of tokens mid-call, or the model forgot it).

    One pass, linear in ``len(text)``: each search starts where the last one ended (a lazy
    pattern rescans the rest of the text from every opening tag, quadratic on a turn of
    unclosed tags), and each call's body is parsed once."""
    calls: list[ToolCall] = []
    malformed: list[str] = []
    content: list[str] = []
    at = 0
    while (start := text.find(_OPEN_TAG, at)) >= 0:
        content.append(text[at:start])
        end = text.find(_CLOSE_TAG, start + len(_OPEN_TAG))
        if end < 0:  # what follows an unclosed tag is the call, not content
            malformed.append(f"{_OPEN_TAG} not closed")
            return ParsedTurn("".join(content).strip(), calls, malformed)
        at = end + len(_CLOSE_TAG)
        parsed = _hermes_call(text[start + len(_OPEN_TAG) : end])
        if isinstance(parsed, str):
            malformed.append(parsed)
        elif len(calls) < MAX_CALLS_PER_TURN:
            calls.append(parsed)
        else:
            malformed.append(f"more than {MAX_CALLS_PER_TURN} calls in one turn")
    content.append(text[at:])
    return ParsedTurn("".join(content).strip(), calls, malformed)


TOOL_CALL_PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}
DEFAULT_FAMILY = "hermes"  # the format our default tool prompt teaches (trainer.agents.chat)
# What a chat template writes that names its family's format (first match wins).
_FAMILY_MARKERS: tuple[tuple[str, str], ...] = (("<tool_call>", "hermes"),)


def parser_family(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tool-call format of the tokenizer's model family, read from its chat template; a
    template with no tool format of its own (SmolLM2's) gets :data:`DEFAULT_FAMILY`, the format
    the default tool prompt asks for."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        for marker, family in _FAMILY_MARKERS:
            if marker in template:
                return family
    return DEFAULT_FAMILY
