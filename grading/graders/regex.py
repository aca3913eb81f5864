"""The ``regex`` grader: a format check by an RE2 pattern (:mod:`grading.regex`). Validation
compiles every pattern the way the grader will, so what RE2 cannot run is a 422."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator

from grading.graders.base import MAX_GRADED_CHARS, GraderSpecBase, Item
from grading.regex import MAX_PATTERN_CHARS, compile_regex

__all__ = ["RegexGrader", "RegexMatch"]


class RegexGrader(GraderSpecBase):
    """1.0 when the pattern matches the completion (a format check)."""

    type: Literal["regex"]
    pattern: str = Field(
        min_length=1,
        max_length=MAX_PATTERN_CHARS,
        description=(
            "RE2 regular expression (https://github.com/google/re2/wiki/Syntax): Python-like "
            "syntax that matches in linear time, without lookaround or backreferences; "
            "\\d, \\w, \\s and \\b are ASCII (\\pL, \\p{Nd} are Unicode) and $ is the very end "
            "of the text (write \\s*$ to allow trailing whitespace)."
        ),
    )
    full_match: bool = Field(
        default=False, description="Require the whole completion to match, not just a part."
    )

    @field_validator("pattern")
    @classmethod
    def _runs_on_re2(cls, pattern: str) -> str:
        compile_regex(pattern)
        return pattern

    def build(self, name: str) -> RegexMatch:
        return RegexMatch(name, self.weight, compile_regex(self.pattern), self.full_match)


def _utf8(text: str) -> str:
    """``text`` with lone surrogates (which UTF-8 cannot encode) replaced by U+FFFD."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


@dataclass(frozen=True)
class RegexMatch:
    """1 when the RE2 ``pattern`` is found in the completion (``search``), or matches all of it
    (``full_match``). RE2 syntax and semantics: see :class:`RegexGrader`."""

    name: str
    weight: float
    pattern: Any  # an RE2 pattern (grading.regex.compile_regex)
    full_match: bool = False

    @classmethod
    def of(cls, name: str, pattern: str, *, weight: float = 1.0, full: bool = False) -> RegexMatch:
        """A regex grader from a pattern string (ValueError if RE2 cannot run it)."""
        return cls(name, weight, compile_regex(pattern), full)

    def __call__(self, completion: str, item: Item) -> float:
        text = completion[-MAX_GRADED_CHARS:]
        try:
            found = self._match(text)
        except UnicodeEncodeError:
            found = self._match(_utf8(text))
        return 1.0 if found is not None else 0.0

    def _match(self, text: str) -> object:
        return self.pattern.fullmatch(text) if self.full_match else self.pattern.search(text)
