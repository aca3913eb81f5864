"""What the loop needs from a reward: a :class:`Scorer`. Graders are one kind; a plain batch
function is another.

The loop scores every completion of a step with ``scorer.score(completions, items)`` and
reports ``reward/<name>/mean`` for each of ``scorer.names``. ``scorer.max_total`` is the total a
fully correct completion reaches: evaluation counts a held-out row as correct at that total, and
reports the mean total reward instead when it is 0 or less (see ``trainer.run.metrics``).

A scorer that fails quietly (a :class:`~grading.graders.GraderSet` scores a failed grader call
0) also counts those failures: it is a :class:`CountingScorer`, with a ``score_batch`` method.
The step collection calls :func:`score_batch`, which uses it when the scorer has one, and
reports the counts as ``reward/<name>/errors``, ``reward/errors`` and ``reward/timeouts``.

A :class:`~grading.graders.GraderSet` is a Scorer. :class:`RewardFunction` makes one out of a
function ``fn(completions, items) -> rewards`` for callers who would rather write Python than
grader specs (``train(..., reward_fn=fn)`` wraps it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from grading.graders import BatchGrader, Grader, GraderSet, Item, ScoreBatch, build_graders
from jobspec import GraderSpec

__all__ = [
    "CountingScorer",
    "RewardFn",
    "RewardFunction",
    "Scorer",
    "resolve_scorer",
    "score_batch",
]

# The same names the job spec allows for graders, so metric keys look alike.
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
DEFAULT_NAME = "reward_fn"

RewardFn = Callable[[list[str], list[Item]], Sequence[float]]
"""``fn(completions, items) -> rewards``: one float per completion, in order. ``items[i]`` is
completion i's dataset row as a dict of its fields (``items[i].get("answer")`` is its reference
answer, when it has one)."""


class Scorer(Protocol):
    """Scores a step's completions; what ``collect_groups`` and the evaluation call."""

    @property
    def names(self) -> list[str]:
        """The keys of ``score``'s per-component dict (``reward/<name>/mean`` metrics)."""
        ...

    @property
    def max_total(self) -> float:
        """The total reward of a fully correct completion (0 or less: no such notion)."""
        ...

    def score(
        self, completions: Sequence[str], items: Sequence[Item]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """N completions -> (total reward [N], {name: component scores [N]})."""
        ...


@runtime_checkable
class CountingScorer(Scorer, Protocol):
    """A Scorer that also counts the calls that failed quietly (scored 0)."""

    def score_batch(self, completions: Sequence[str], items: Sequence[Item]) -> ScoreBatch: ...


def score_batch(scorer: Scorer, completions: Sequence[str], items: Sequence[Item]) -> ScoreBatch:
    """Score with failure counts: ``scorer.score_batch`` when it has one, else ``scorer.score``
    with no failures counted (such a scorer's failures raise, as a RewardFunction's do)."""
    if isinstance(scorer, CountingScorer):
        return scorer.score_batch(completions, items)
    totals, components = scorer.score(completions, items)
    return ScoreBatch.without_failures(totals, components)


class RewardFunction:
    """A Scorer that calls ``fn(completions, items)`` once per batch.

    ``name`` (default: the function's ``__name__`` when it is a valid grader name, such as
    ``length_reward``, else ``reward_fn``) is the metric key ``reward/<name>/mean``.
    ``max_total`` is the reward of a correct answer for ``eval/accuracy``; the default 0 makes
    the evaluation report the mean reward, since nothing is known about the function's range.

    Unlike graders, which score 0 when they fail, an exception of ``fn`` propagates and ends the
    run: in a notebook the traceback is worth more than a silent zero. A result of the wrong
    length or a non-finite value raises ValueError for the same reason.
    """

    def __init__(self, fn: RewardFn, *, name: str | None = None, max_total: float = 0.0) -> None:
        if not callable(fn):
            raise TypeError(f"reward_fn must be callable, got {type(fn).__name__}")
        if name is None:
            default = getattr(fn, "__name__", "")
            name = default if _NAME.match(default) else DEFAULT_NAME
        if not _NAME.match(name):
            raise ValueError(f"reward name {name!r} must match {_NAME.pattern}")
        if not math.isfinite(max_total):
            raise ValueError(f"max_total must be finite, got {max_total}")
        self.fn = fn
        self.name = name
        self._max_total = float(max_total)

    @property
    def names(self) -> list[str]:
        return [self.name]

    @property
    def max_total(self) -> float:
        return self._max_total

    def score(
        self, completions: Sequence[str], items: Sequence[Item]
    ) -> tuple[list[float], dict[str, list[float]]]:
        if len(completions) != len(items):
            raise ValueError(f"{len(completions)} completions but {len(items)} items")
        # Fresh lists (and rows): the function may keep or modify what it is given.
        raw = self.fn(list(completions), [dict(item) for item in items])
        rewards = [float(r) for r in raw]
        if len(rewards) != len(completions):
            raise ValueError(
                f"reward function {self.name!r} returned {len(rewards)} rewards "
                f"for {len(completions)} completions"
            )
        bad = [r for r in rewards if not math.isfinite(r)]
        if bad:
            raise ValueError(f"reward function {self.name!r} returned non-finite rewards {bad[:3]}")
        return rewards, {self.name: list(rewards)}


def resolve_scorer(
    graders: Scorer | Sequence[Grader | BatchGrader] | None,
    reward_fn: RewardFn | None,
    specs: Sequence[GraderSpec],
) -> Scorer:
    """The run's Scorer: ``reward_fn`` wrapped, ``graders`` (a list becomes a GraderSet), or,
    when neither is given, the graders of the job spec (``specs``)."""
    if graders is not None and reward_fn is not None:
        raise ValueError("pass graders or reward_fn, not both")
    if reward_fn is not None:
        return RewardFunction(reward_fn)
    if graders is None:
        return build_graders(specs)
    if isinstance(graders, Sequence):
        return GraderSet(list(graders))
    return graders
