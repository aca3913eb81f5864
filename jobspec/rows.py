"""One prompt row of a dataset: a prompt or a conversation, an optional reference answer, and
the row's own fields, which graders read as ``item.*`` (bounded: how many, how deep, how long).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from jobspec.base import MAX_TEXT_CHARS
from specbase import StrictModel, text_problem

__all__ = ["ChatMessage", "PromptRow", "row_fields_problem"]


# Bounds of a row's own fields (besides prompt/messages/answer), which graders read as item.*.
MAX_ROW_FIELDS = 64
MAX_ROW_FIELD_CHARS = 100_000  # one field's value, as compact JSON
MAX_ROW_DEPTH = 8
MAX_MESSAGES = 64
FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant"] = Field(description="Who speaks.")
    content: str = Field(max_length=MAX_TEXT_CHARS, description="What is said.")


def _json_value_problem(value: Any, depth: int = 0) -> str | None:
    """Why ``value`` is not a bounded JSON value of a row field, or None."""
    if depth > MAX_ROW_DEPTH:
        return f"is nested deeper than {MAX_ROW_DEPTH} levels"
    if value is None or isinstance(value, bool | int | str):
        return text_problem(value) if isinstance(value, str) else None
    if isinstance(value, float):
        return None if math.isfinite(value) else "must be a finite number"
    if isinstance(value, list):
        for item in value:
            problem = _json_value_problem(item, depth + 1)
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or text_problem(key):
                return "has a key that is not storable text"
            problem = _json_value_problem(item, depth + 1)
            if problem:
                return problem
        return None
    return f"must be JSON (a string, number, boolean, null, list or object), not {type(value).__name__}"


def row_fields_problem(fields: Mapping[str, Any]) -> str | None:
    """Why ``fields`` are not acceptable as a row's own fields (what graders read as ``item``),
    or None: at most MAX_ROW_FIELDS, identifier names, bounded JSON values."""
    if len(fields) > MAX_ROW_FIELDS:
        return f"a row has at most {MAX_ROW_FIELDS} fields besides prompt/messages"
    for name, value in fields.items():
        if not isinstance(name, str) or not FIELD_NAME.match(name):
            return f"field names are identifiers (letters, digits, _; at most 64), got {name!r:.80}"
        problem = _json_value_problem(value)
        if problem is None and len(json.dumps(value)) > MAX_ROW_FIELD_CHARS:
            problem = f"is over {MAX_ROW_FIELD_CHARS} characters as JSON"
        if problem:
            return f"field {name} {problem}"
    return None


class PromptRow(StrictModel):
    """One dataset row: a ``prompt`` or a conversation (``messages``), an optional reference
    ``answer``, and any other fields, kept as they are and handed to graders as ``item``
    (``{{ item.test_cases }}``; a python grader's ``item["test_cases"]``)."""

    model_config = ConfigDict(extra="allow")

    prompt: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TEXT_CHARS,
        description="The user prompt sent to the model (or give messages).",
    )
    messages: list[ChatMessage] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_MESSAGES,
        description=(
            "A conversation ending with a user turn, formatted with the chat template; a "
            "system turn here is the row's own system prompt."
        ),
    )
    answer: str | None = Field(
        default=None,
        max_length=MAX_TEXT_CHARS,
        description="Optional reference answer the graders compare completions against.",
    )

    @model_validator(mode="after")
    def _one_prompt_and_bounded_fields(self) -> PromptRow:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None:
            if self.messages[-1].role != "user":
                raise ValueError("messages must end with a user turn (the model answers it)")
            if any(m.role == "system" for m in self.messages[1:]):
                raise ValueError("a system message may only come first")
        problem = row_fields_problem(self.model_extra or {})
        if problem:
            raise ValueError(problem)
        return self

    @model_serializer(mode="wrap")
    def _without_the_unused_form(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A row is a prompt or a conversation: the other key is left out rather than stored as
        # null in every row of every spec.
        data = handler(self)
        if isinstance(data, dict):
            for key in ("prompt", "messages"):
                if data.get(key, 0) is None:
                    del data[key]
        return data

    @property
    def item(self) -> dict[str, Any]:
        """The row as graders see it: every field it was given (prompt or messages included)."""
        return self.model_dump(mode="json", exclude_unset=True, exclude_none=True)

    @property
    def display_prompt(self) -> str:
        """The prompt as a person reads it: the text, or the conversation's last user turn."""
        if self.prompt is not None:
            return self.prompt
        assert self.messages is not None
        return self.messages[-1].content
