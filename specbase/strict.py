"""The strict model every spec derives from (each section of the job spec, each grader type's
spec): its values are storable, so these rules hold for every field, present and future, without
a per-field declaration:

- unknown fields are errors (a typo is a 422 naming the field, not an ignored setting);
- floats must be finite (``Infinity``/``NaN``, Python's or JSON's, are refused);
- text must be storable in Postgres (``text``/``jsonb``): no NUL character and no lone surrogate
  (which cannot be encoded as UTF-8), in any string, list item, or dict key or value.

Numeric fields must also declare both bounds; tests/jobspec/test_config_bounds.py walks the
published JSON schema and fails on any integer or number without a minimum and a maximum.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

__all__ = ["StrictModel", "field_error", "literal_tag", "text_problem"]


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be stored as Postgres text or JSON, or None when it can."""
    if "\x00" in text:
        return f"must not contain NUL characters (\\u0000; first at position {text.index(chr(0))})"
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        return (
            f"must be valid Unicode text: lone surrogate \\u{ord(bad):04x} at position "
            f"{exc.start} cannot be encoded as UTF-8"
        )
    return None


def _check_storable(value: Any, where: str) -> None:
    """Raise ValueError for the first unstorable string in ``value`` (str, or plain containers
    of them; nested spec models check their own fields)."""
    if isinstance(value, str):
        problem = text_problem(value)
        if problem is not None:
            raise ValueError(f"{where} {problem}")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_storable(key, f"{where} key {key!r:.40}")
            _check_storable(item, f"{where}[{key!r:.40}]")
    elif isinstance(value, list | tuple | set | frozenset):
        for i, item in enumerate(value):
            _check_storable(item, f"{where}[{i}]")


class StrictModel(BaseModel):
    """Base for every spec section: unknown fields are errors, floats are finite, text is
    storable, and values are validated on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _storable_text(cls, value: Any, info: ValidationInfo) -> Any:
        # Runs for every field of every row: the common cases return at once.
        if type(value) is str and "\x00" not in value and value.isascii():
            return value
        if isinstance(value, str | Mapping | list | tuple | set | frozenset):
            _check_storable(value, info.field_name or "value")
        return value


def literal_tag(model: type[BaseModel], field: str = "type") -> str:
    """The single value of a ``field: Literal["tag"]`` of a spec class (its union tag)."""
    values = get_args(model.model_fields[field].annotation)
    if len(values) != 1 or not isinstance(values[0], str):
        raise TypeError(f"{model.__name__}.{field} must be a Literal of one string")
    return values[0]


def field_error(loc: tuple[str | int, ...], message: str, value: Any) -> ValidationError:
    """An error about the field at ``loc`` below the field being validated, for a rule that
    only a parent can check (it needs a sibling's value) but that the user must read as the
    field's own: raised from a parent's validator, pydantic keeps the location, so the API's
    422 names ``resources.devices``, not ``resources``."""
    # Without a context the template is not formatted: the message is shown as it is.
    error = PydanticCustomError("value_error", message)
    return ValidationError.from_exception_data(
        "JobSpec", [InitErrorDetails(type=error, loc=loc, input=value)]
    )
