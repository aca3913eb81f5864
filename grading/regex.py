"""The regex engine the graders' patterns run on (RE2), and how a pattern is compiled.

Regex patterns are compiled with RE2 (the ``google-re2`` package), which matches in time linear
in the text: no pattern can backtrack catastrophically (Python's ``re`` takes minutes on
``(\\w+\\s?)+$`` against 49 characters of prose, holding the GIL). The price is RE2's syntax:
no lookaround, no backreferences, no possessive or atomic groups, and ASCII ``\\d \\w \\s \\b``.
Validation compiles every pattern the way the grader will, so what RE2 cannot run is a 422.
"""

from __future__ import annotations

from typing import Any

import re2

__all__ = ["MAX_PATTERN_CHARS", "REGEX_MAX_MEM", "compile_regex"]

MAX_PATTERN_CHARS = 500

# RE2's memory budget for one compiled pattern (program plus DFA cache; RE2's default is 8 MiB).
# A pattern whose program does not fit fails to compile ("too large"), which bounds both the
# memory of a job's 16 graders and the time the API spends compiling a submitted pattern
# (about 0.06 s at most at 4 MiB, against 0.3 s at 8 MiB); matching stays linear in the text.
REGEX_MAX_MEM = 4 << 20

_LINEAR_TIME = (
    "lookaround ((?=, (?!, (?<=, (?<!), backreferences (\\1, (?P=name)) and possessive or "
    "atomic groups (a*+, (?>...)) are not supported, because patterns must run in linear time "
    "(RE2)"
)


def _options() -> Any:
    options = re2.Options()
    options.max_mem = REGEX_MAX_MEM
    options.log_errors = False  # a bad user pattern is a 422, not a line in the server log
    return options


def _explain(detail: str, pattern: str) -> str:
    """A user-facing message for RE2's error ``detail`` (e.g. "invalid perl operator: (?=")."""
    if (
        detail.endswith(("(?=", "(?!", "(?<=", "(?<!", "(?>"))
        or (detail.startswith("bad repetition operator") and detail.endswith("+"))
        or (detail.endswith("(?P") and "(?P=" in pattern)
        or (detail.startswith("invalid escape sequence: \\") and detail[-1:].isdigit())
    ):
        return f"{detail}: {_LINEAR_TIME}"
    if detail == "invalid escape sequence: \\Z":
        return f"{detail}: write \\z for the end of the text"
    if detail.startswith("pattern too large"):
        return (
            f"{detail}: the compiled pattern needs more than {REGEX_MAX_MEM >> 20} MiB; "
            "use smaller counted repetitions ({n,m}) or fewer Unicode classes"
        )
    return f"{detail} (RE2 syntax: https://github.com/google/re2/wiki/Syntax)"


def compile_regex(pattern: str) -> Any:
    """``pattern`` compiled with RE2 under :data:`REGEX_MAX_MEM`; ValueError (with a message for
    the user) when RE2 cannot run it.

    Deliberately not ``re2.compile``: that caches the last 128 patterns, and the API compiles
    every pattern it is sent, so a stream of large distinct patterns would be kept alive there.
    """
    uncached = getattr(re2, "_Regexp", None)  # google-re2's pattern class, if still there
    try:
        if uncached is None:
            return re2.compile(pattern, _options())
        return uncached(pattern, _options())
    except re2.error as exc:
        raw = exc.args[0] if exc.args else ""
        detail = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        raise ValueError(f"pattern is not supported: {_explain(detail, pattern)}") from None
    except UnicodeEncodeError as exc:  # a lone surrogate (the text check reports it too)
        raise ValueError(f"pattern is not valid Unicode text: {exc.reason}") from None
