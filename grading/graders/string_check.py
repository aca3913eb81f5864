"""OpenAI's ``string_check`` grader: two templates of the sample and the row
(:mod:`grading.templates`) compared as text."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from grading.graders.base import ComparesTexts, Item, TextPair

__all__ = ["StringCheck", "StringCheckGrader"]


class StringCheckGrader(ComparesTexts):
    """OpenAI's string_check: 1.0 when ``input`` and ``reference`` (both templates) compare as
    ``operation`` says: eq (equal), ne (not equal), like (reference contained in input), ilike
    (the same, ignoring case)."""

    type: Literal["string_check"]
    operation: Literal["eq", "ne", "like", "ilike"] = Field(description="How they compare.")

    def build(self, name: str) -> StringCheck:
        return StringCheck(name, self.weight, self.input, self.reference, self.operation)


_OPERATIONS: dict[str, Callable[[str, str], bool]] = {
    "eq": lambda text, ref: text == ref,
    "ne": lambda text, ref: text != ref,
    "like": lambda text, ref: ref in text,
    "ilike": lambda text, ref: ref.casefold() in text.casefold(),
}


@dataclass(frozen=True)
class StringCheck(TextPair):
    """1.0 when the rendered ``input`` and ``reference`` compare as ``operation`` says."""

    operation: str

    def __call__(self, completion: str, item: Item) -> float:
        text, ref = self.rendered(completion, item)
        return 1.0 if _OPERATIONS[self.operation](text, ref) else 0.0
