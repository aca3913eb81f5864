"""How a conversation with tools reaches the model: through its chat template, rendered to
token ids.

:func:`chat_format` looks at the tokenizer once:

- ``native_tools``: the template renders ``tools=`` (a render with a probe tool differs from one
  without). Then the tool schemas go in through ``tools=``.
- otherwise the **default** (SmolLM2, the tiny test model): the schemas and the call format go
  into the system turn (:func:`default_tool_prompt`; a conversation's own system turn keeps its
  text after ours), calls are Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``.
- ``tool_role``: the template renders a ``tool`` message (a probe result appears in the render).
  Otherwise a tool result is a user turn that starts with :data:`TOOL_RESULT_PREFIX`.

Assistant turns are put back as the text the model sampled (special tokens kept, the end token
left for the template to write), never as structured ``tool_calls``: a template re-serialising
the call's JSON would not give back the sampled tokens.

Tool results and environment messages are :class:`~trainer.agents.outside.OutsideText`: the
render tokenises them as plain text, so a special token written inside one is never a turn
marker (:class:`~trainer.agents.outside.PlainTextEncoder`).

:meth:`ChatFormat.continuation` is what a template writes after an assistant turn for the
messages that follow it, rendered after a fixed probe exchange rather than after the episode's
own turns; the driver appends it where re-rendering the whole conversation would change the
turns already sampled (template drift, :mod:`trainer.agents.episode`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from jobspec.prompt_format import (
    TOOL_RESULT_PREFIX,
    Message,
    default_tool_prompt,
    tool_result_message,
    with_tool_prompt,
)
from trainer.agents.outside import OutsideText, PlainTextEncoder, outside
from trainer.agents.parsing import TOOL_CALL_PARSERS, ParsedTurn, parser_family

__all__ = [
    "TOOL_RESULT_PREFIX",
    "ChatFormat",
    "Message",
    "chat_format",
    "default_tool_prompt",
]

_PROBE_NAME = "grpo_probe_tool_7f3a"
_PROBE_RESULT = "grpo-probe-result-7f3a"
# The exchange a continuation is rendered after: plain words no template trims or rewrites.
_PROBE_QUESTION = "grpo-probe-question-7f3a"
_PROBE_ANSWER = "grpo-probe-answer-7f3a"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _PROBE_NAME,
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


def _render_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> str:
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        tokenize=False,
        add_generation_prompt=True,
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, not str")
    return text


def _renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    probe = [{"role": "user", "content": "hi"}]
    try:
        with_tools = _render_text(tokenizer, probe, [_PROBE_TOOL])
    except Exception:  # a template that chokes on tools= has no tool support
        return False
    return with_tools != _render_text(tokenizer, probe, None) and _PROBE_NAME in with_tools


def _renders_tool_role(tokenizer: PreTrainedTokenizerBase) -> bool:
    probe = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "call"},
        {"role": "tool", "content": _PROBE_RESULT, "name": _PROBE_NAME},
    ]
    try:
        return _PROBE_RESULT in _render_text(tokenizer, probe, None)
    except Exception:  # templates that raise on an unknown role ("roles must alternate")
        return False


@dataclass(frozen=True)
class ChatFormat:
    """A tokenizer's way with tools (see the module docstring)."""

    tokenizer: PreTrainedTokenizerBase
    tools: tuple[Mapping[str, Any], ...]  # OpenAI function-tool dicts, as the template takes them
    native_tools: bool
    tool_role: bool
    family: str
    encoder: PlainTextEncoder

    def initial(self, messages: Sequence[Mapping[str, Any]]) -> list[Message]:
        """The conversation an episode starts from: ``messages`` with, when the template does
        not render tools itself, the default tool prompt in the system turn."""
        if self.native_tools:
            return [dict(m) for m in messages]
        return with_tool_prompt(messages, self.tools)

    def render(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of ``messages`` and the assistant generation prompt (the template writes
        its own special tokens, BOS included; outside text is plain text)."""
        return self.encoder.encode(self._text(messages))

    def continuation(self, new: Sequence[Mapping[str, Any]], end_token: int) -> list[int] | None:
        """The tokens the template writes after an assistant turn that ended with the token
        ``end_token`` for the messages ``new`` that follow it, through the next generation
        prompt; None when its render does not show where that starts (the turn's closing
        does not begin with that token's text)."""
        probe = [
            {"role": "user", "content": _PROBE_QUESTION},
            {"role": "assistant", "content": _PROBE_ANSWER},
        ]
        try:
            text = self._text([*probe, *new])
        except Exception:  # a template that refuses the probe exchange: no continuation
            return None
        # The first occurrence is the probe's: the new messages come after it.
        at = text.find(_PROBE_ANSWER)
        after = text[at + len(_PROBE_ANSWER) :]
        closing = str(self.tokenizer.decode([end_token]))
        if at < 0 or not closing or not after.startswith(closing):
            return None
        return self.encoder.encode(after[len(closing) :])

    def _text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        tools = self.tools if self.native_tools and self.tools else None
        marked = [
            {**m, "content": self.encoder.mark(m["content"])}
            if isinstance(m.get("content"), OutsideText)
            else m
            for m in messages
        ]
        return _render_text(self.tokenizer, marked, tools)

    def assistant_message(self, sampled: Sequence[int], stop_ids: Sequence[int]) -> Message:
        """The assistant turn as the model sampled it: its tokens decoded with special tokens
        kept, less a final end token (which the template writes itself)."""
        ids = list(sampled)
        if ids and ids[-1] in set(stop_ids):
            ids = ids[:-1]
        return {"role": "assistant", "content": self.tokenizer.decode(ids)}

    def tool_message(self, name: str, content: str) -> Message:
        """A tool's result as the template takes it: a ``tool`` turn, or a prefixed user turn;
        its content is outside text."""
        message = tool_result_message(name, content, tool_role=self.tool_role)
        return {**message, "content": outside(message["content"])}

    def parse(self, text: str) -> ParsedTurn:
        """The tool calls of an assistant turn's text, by the family's parser."""
        return TOOL_CALL_PARSERS[self.family](text)


def chat_format(
    tokenizer: PreTrainedTokenizerBase, tools: Sequence[Mapping[str, Any]] = ()
) -> ChatFormat:
    """Probe ``tokenizer``'s template once (see the module docstring)."""
    return ChatFormat(
        tokenizer=tokenizer,
        tools=tuple(tools),
        native_tools=_renders_tools(tokenizer),
        tool_role=_renders_tool_role(tokenizer),
        family=parser_family(tokenizer),
        encoder=PlainTextEncoder(tokenizer),
    )
