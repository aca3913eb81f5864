"""Tool calls out of an assistant turn's text, by the model family's format.

The formats and their parsers are declared once, torch-free, in
:mod:`jobspec.prompt_format`, where the served model reads them too (an agent trained here
is called as an agent through ``/v1/chat/completions``); this module names them for the
trainer and reads a tokenizer's family.

A parser never raises on what the model wrote: a call it cannot read is returned as a
``malformed`` reason (an episode event, counted in ``tools/malformed``), and the text around
the calls is the turn's content. Families (:data:`TOOL_CALL_PARSERS`): ``hermes``,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5/Qwen3, and our
default format for templates without tool support, SmolLM2's included).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from jobspec.prompt_format import (
    DEFAULT_FAMILY,
    MAX_CALLS_PER_TURN,
    TOOL_CALL_PARSERS,
    ParsedTurn,
    ToolCall,
    parse_hermes,
    template_family,
)

__all__ = [
    "DEFAULT_FAMILY",
    "MAX_CALLS_PER_TURN",
    "TOOL_CALL_PARSERS",
    "ParsedTurn",
    "ToolCall",
    "parse_hermes",
    "parser_family",
]


def parser_family(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tool-call format of the tokenizer's model family, read from its chat template
    (:func:`~jobspec.prompt_format.template_family`)."""
    template = getattr(tokenizer, "chat_template", None)
    return template_family(template if isinstance(template, str) else None)
