"""Quality gates for CI: `--timeout` durations and `--require` metric thresholds.

Pure functions, no I/O. A requirement is checked against a job's *final* value of a metric: the
value recorded at the last step that has that metric. Most metrics are recorded every step, so
that is the last step of the run; metrics recorded only now and then (eval/accuracy, every
`eval.interval` steps) use their latest recording.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_duration(text: str) -> float:
    """Seconds in a duration such as `90s`, `30m`, `2h`, `1h30m` or a bare `45` (seconds)."""
    raw = text.strip().lower()
    if re.fullmatch(r"\d+(?:\.\d+)?", raw):
        seconds = float(raw)
    else:
        parts = _DURATION_PART.findall(raw)
        if not parts or "".join(n + u for n, u in parts) != raw:
            raise ValueError(
                f"invalid duration {text!r}: use a number with a unit, like 90s, 30m, 2h or 1h30m"
            )
        units = [u for _, u in parts]
        if len(set(units)) != len(units):
            raise ValueError(f"invalid duration {text!r}: a unit appears twice")
        seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError(f"invalid duration {text!r}: must be more than zero")
    return seconds


def format_duration(seconds: float) -> str:
    """`3725.4` -> `1h2m5s`: short and exact to the second, for messages."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    out = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "")
    return out + (f"{secs}s" if secs or not out else "")


# Longest operators first, so `>=` is never read as `>` followed by `=0.6`.
OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    ">": operator.gt,
    "<": operator.lt,
}
_REQUIREMENT = re.compile(r"^\s*([^\s<>=!]+)\s*(>=|<=|==|>|<)\s*(\S+)\s*$")


@dataclass(frozen=True)
class Requirement:
    metric: str
    op: str
    threshold: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"

    def holds(self, value: float) -> bool:
        return OPERATORS[self.op](value, self.threshold)


def parse_requirement(text: str) -> Requirement:
    """`reward/mean>=0.6` -> Requirement("reward/mean", ">=", 0.6). Operators: >= <= == > <."""
    match = _REQUIREMENT.match(text)
    if not match:
        raise ValueError(
            f"invalid requirement {text!r}: write METRIC OP NUMBER, e.g. 'reward/mean>=0.6' "
            "(operators: >=, <=, ==, >, <)"
        )
    metric, op, number = match.groups()
    try:
        threshold = float(number)
    except ValueError:
        raise ValueError(f"invalid requirement {text!r}: {number!r} is not a number") from None
    if not math.isfinite(threshold):
        raise ValueError(f"invalid requirement {text!r}: the threshold must be finite")
    return Requirement(metric, op, threshold)


@dataclass(frozen=True)
class FinalValue:
    step: int
    value: float


def final_values(series: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, FinalValue]:
    """The last recorded point of each metric series (as returned by GET /v1/jobs/{id}/metrics,
    without downsampling); metrics with no finite value are left out."""
    out: dict[str, FinalValue] = {}
    for name, points in series.items():
        if points:
            last = max(points, key=lambda p: int(p["step"]))
            out[name] = FinalValue(int(last["step"]), float(last["value"]))
    return out


@dataclass(frozen=True)
class Verdict:
    requirement: Requirement
    final: FinalValue | None  # None: the job never recorded this metric

    @property
    def passed(self) -> bool:
        return self.final is not None and self.requirement.holds(self.final.value)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requirement": str(self.requirement),
            "metric": self.requirement.metric,
            "op": self.requirement.op,
            "threshold": self.requirement.threshold,
            "value": None if self.final is None else self.final.value,
            "step": None if self.final is None else self.final.step,
            "passed": self.passed,
        }


def check(requirements: Sequence[Requirement], finals: Mapping[str, FinalValue]) -> list[Verdict]:
    """One verdict per requirement; a metric the job never recorded fails its requirement."""
    return [Verdict(r, finals.get(r.metric)) for r in requirements]
