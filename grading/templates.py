"""``{{ sample.output_text }}`` / ``{{ item.answer }}`` templates of graders, without a template engine.

Grader settings (OpenAI's grader format) refer to the completion and to the dataset row through
double-brace placeholders: ``{{ sample.output_text }}``, ``{{ sample.output_json.answer }}``,
``{{ item.answer }}``, ``{{ item.test_cases.0.input }}``. A placeholder is a path of names and
list indices, nothing else: no expressions, filters or calls, so a template a tenant submits can
only read the two namespaces it is given (no Jinja sandbox to escape). Everything outside the
placeholders is literal text.

Rendering: a string is inserted as it is, ``None`` as the empty string, any other value as
compact JSON. A path that does not exist in the row raises :class:`TemplateError`: the grader
then fails for that sample (scored 0 and counted), which shows a dataset that lacks the field
instead of comparing against an empty string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "MAX_TEMPLATE_CHARS",
    "NAMESPACES",
    "EpisodeAnswer",
    "TemplateError",
    "check_template",
    "check_template_field",
    "render",
    "sample_namespace",
]

MAX_TEMPLATE_CHARS = 10_000
MAX_RENDERED_CHARS = 200_000
NAMESPACES = ("sample", "item")

_SEGMENT = r"[A-Za-z_][A-Za-z0-9_]{0,63}|[0-9]{1,6}"
_PLACEHOLDER = re.compile(r"\{\{\s*(sample|item)((?:\.(?:" + _SEGMENT + r"))*)\s*\}\}")
_ANY_BRACES = re.compile(r"\{\{.*?\}\}", re.DOTALL)


class TemplateError(ValueError):
    """A template that cannot be parsed, or a placeholder whose path the data does not have."""


def check_template(template: str) -> str:
    """``template`` when every ``{{ ... }}`` in it is a valid placeholder; else TemplateError
    saying which one and what a placeholder may be."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateError(f"templates are at most {MAX_TEMPLATE_CHARS} characters")
    for braces in _ANY_BRACES.finditer(template):
        if not _PLACEHOLDER.fullmatch(braces.group(0)):
            raise TemplateError(
                f"{braces.group(0)[:80]!r} is not a placeholder: write {{{{ sample.output_text }}}}"
                " or {{ item.<field>[.<field or index>...] }}"
            )
    return template


def check_template_field(value: str) -> str:
    """:func:`check_template` as a spec field's validator: its refusal is a plain ValueError,
    which pydantic reports as the field's error (a 422 naming the field)."""
    try:
        return check_template(value)
    except TemplateError as exc:
        raise ValueError(str(exc)) from None


class EpisodeAnswer(str):
    """An agent episode's final answer (the text graders grade as ``sample.output_text``) that
    also carries the episode's transcript: ``messages`` (the conversation) and ``tool_calls``
    (name, arguments and result of each call), which :func:`sample_namespace` adds to
    ``sample``. A ``str`` everywhere else, so every grader takes it as a completion."""

    messages: list[dict[str, Any]]
    tool_calls: list[dict[str, Any]]

    def __new__(
        cls,
        text: str,
        messages: Sequence[Mapping[str, Any]] = (),
        tool_calls: Sequence[Mapping[str, Any]] = (),
    ) -> EpisodeAnswer:
        answer = super().__new__(cls, text)
        answer.messages = [dict(m) for m in messages]
        answer.tool_calls = [dict(c) for c in tool_calls]
        return answer

    def __reduce__(self) -> tuple[Any, ...]:
        return (EpisodeAnswer, (str(self), self.messages, self.tool_calls))


def sample_namespace(completion: str) -> dict[str, Any]:
    """What ``sample`` holds for one completion: ``output_text``, and ``output_json`` when the
    text is a JSON document (else None); for an agent episode (an :class:`EpisodeAnswer`) also
    ``messages`` and ``tool_calls``."""
    try:
        parsed: Any = json.loads(completion) if completion.lstrip()[:1] in ("{", "[") else None
    except (ValueError, RecursionError):
        parsed = None
    out: dict[str, Any] = {"output_text": str(completion), "output_json": parsed}
    if isinstance(completion, EpisodeAnswer):
        out["messages"] = completion.messages
        out["tool_calls"] = completion.tool_calls
    return out


def _lookup(root: Any, namespace: str, path: str) -> Any:
    value = root
    for segment in [s for s in path.split(".") if s]:
        if isinstance(value, Mapping) and segment in value:
            value = value[segment]
        elif (
            isinstance(value, Sequence)
            and not isinstance(value, str)
            and segment.isdigit()
            and int(segment) < len(value)
        ):
            value = value[int(segment)]
        else:
            raise TemplateError(f"{namespace}{path} is not in the {namespace}")
    return value


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def render(template: str, *, sample: Mapping[str, Any], item: Mapping[str, Any]) -> str:
    """``template`` with each placeholder replaced by its value (see the module docstring)."""
    roots = {"sample": sample, "item": item}

    def replace(match: re.Match[str]) -> str:
        namespace, path = match.group(1), match.group(2)
        return _as_text(_lookup(roots[namespace], namespace, path))

    out = _PLACEHOLDER.sub(replace, template)
    if len(out) > MAX_RENDERED_CHARS:
        raise TemplateError(f"the rendered text is over {MAX_RENDERED_CHARS} characters")
    return out
