"""Where in a request a validation error is, as users write it: `graders[0].pattern`, not
pydantic's `('body', 'graders', 0, 'regex', 'pattern')`. Shared by the error handlers and the
services that validate a body they built (app.fine_tuning.service)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from jobspec import JobSpec

_LOCATIONS = {"body", "query", "path", "header", "cookie"}


def discriminated_union_tags(model: type[BaseModel]) -> frozenset[str]:
    """The tags of every discriminated union reachable from ``model``'s fields (nested models,
    lists and Annotated[..., Field(discriminator=...)] included): the values of each member's
    ``Literal`` discriminator field."""
    tags: set[str] = set()
    seen: set[type[BaseModel]] = set()

    def visit(tp: Any, discriminator: str | None) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp not in seen:
                seen.add(tp)
                for field in tp.model_fields.values():
                    disc = field.discriminator
                    visit(field.annotation, disc if isinstance(disc, str) else None)
            return
        if get_origin(tp) is Annotated:
            base, *metadata = get_args(tp)
            for meta in metadata:
                if isinstance(meta, FieldInfo) and isinstance(meta.discriminator, str):
                    discriminator = meta.discriminator
            visit(base, discriminator)
            return
        for member in get_args(tp):
            if (
                discriminator is not None
                and isinstance(member, type)
                and issubclass(member, BaseModel)
                and discriminator in member.model_fields
            ):
                tag_type = member.model_fields[discriminator].annotation
                tags.update(v for v in get_args(tag_type) if isinstance(v, str))
            visit(member, None)

    visit(model, None)
    return frozenset(tags)


# Discriminated unions put the tag in the error location (graders.0.regex.pattern); users wrote
# graders[0].pattern, so the tag is dropped from the path we report. Derived from the job spec,
# so a new grader type needs no change here.
_UNION_TAGS = discriminated_union_tags(JobSpec)

# The labels pydantic puts in an error's location for the member of a plain union that failed
# (`"auto" | int` fails as literal['auto'] and constrained-int; `str | list[Part]` as str and
# list[Part]): not fields, so left out.
_UNION_MEMBER = re.compile(
    r"^(literal\[.*\]|constrained-\w+|function-\w+\[.*\]|list\[.*\]|int|float|str|bool)$"
)


# Fields that hold one member of a discriminated union (a list's items are recognised by their
# index): the member's tag follows them in an error's location.
_UNION_FIELDS = frozenset({"grader"})


def field_path(loc: Sequence[Any]) -> str:
    parts = [p for p in loc if not (isinstance(p, str) and _UNION_MEMBER.match(p))]
    if parts and parts[0] in _LOCATIONS:
        parts = parts[1:]
    out = ""
    for i, part in enumerate(parts):
        previous = parts[i - 1] if i else None
        holder = parts[i - 2] if i > 1 else None
        is_tag = part in _UNION_TAGS and (
            isinstance(previous, int)
            or previous in _UNION_FIELDS
            # a multi grader's sub-grader: graders.<name>.<tag>
            or (holder == "graders" and isinstance(previous, str))
        )
        if isinstance(part, int):
            out += f"[{part}]"
        elif not is_tag:
            out += ("." if out else "") + str(part)
    return out or "body"
