"""How a step's groups are sampled: a :class:`Rollout` turns rows into ``G`` samples each.

:class:`SingleTurn` is the default: one engine ``generate`` call of ``G`` completions per
prompt. An agent job's rollout (``trainer.run.episodes``) runs multi-turn episodes instead and
fills the optional parts of :class:`Rolled`: a prompt per sample (an episode's sample starts
from its own first prompt), what graders read of each sample (its final answer with the
transcript), what the rollout viewer shows of it (its turns, bounded), extra reward components
(the environment's reward, weighted like a grader) and the step's episode metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from jobspec import GRPOSpec
from trainer.data.dataset import Example
from trainer.rollout.base import Completion, RolloutEngine

__all__ = ["Rolled", "Rollout", "SingleTurn", "merge_metrics"]


@dataclass
class Rolled:
    """``G`` samples for each of N rows, and what scoring and metrics need beyond their text."""

    completions: list[list[Completion]]  # [N][G]
    # [N][G] each sample's prompt ids (None: the row's prompt, as for single completions)
    prompts: list[list[list[int]]] | None = None
    # [N*G] what graders grade of each sample (None: the completions' text)
    texts: list[str] | None = None
    # [N*G] what the rollout viewer shows of each episode (None: single completions; JSON of
    # trainer.agents.sample_transcript, bounded)
    transcripts: list[dict[str, Any]] | None = None
    # component name -> (weight, [N*G] unweighted values), added to the total reward
    extra_rewards: dict[str, tuple[float, list[float]]] = field(default_factory=dict)
    # (episodes, their mean metrics) of this batch of rows; summed by count over a step
    metrics: list[tuple[int, dict[str, float]]] = field(default_factory=list)


class Rollout(Protocol):
    """Samples ``group_size`` completions (or episodes) per row."""

    @property
    def extra_names(self) -> list[str]:
        """The names of :attr:`Rolled.extra_rewards` (``reward/<name>/mean`` metrics)."""
        ...

    def sample(
        self,
        engine: RolloutEngine,
        prompt_ids: Sequence[list[int]],
        examples: Sequence[Example],
        group_size: int,
        spec: GRPOSpec,
        *,
        seed: int,
        greedy: bool = False,
    ) -> Rolled: ...


class SingleTurn:
    """One completion per sample: ``engine.generate(prompts, group_size)``."""

    @property
    def extra_names(self) -> list[str]:
        return []

    def sample(
        self,
        engine: RolloutEngine,
        prompt_ids: Sequence[list[int]],
        examples: Sequence[Example],
        group_size: int,
        spec: GRPOSpec,
        *,
        seed: int,
        greedy: bool = False,
    ) -> Rolled:
        results = engine.generate(
            [list(p) for p in prompt_ids],
            group_size,
            max_new_tokens=spec.max_new_tokens,
            temperature=spec.temperature,
            seed=seed,
            greedy=greedy,
        )
        return Rolled([list(group) for group in results])


def merge_metrics(parts: Sequence[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Means over several batches of episodes, each weighted by its episode count (a metric
    some batch lacks is averaged over the batches that have it)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for n, metrics in parts:
        for name, value in metrics.items():
            sums[name] = sums.get(name, 0.0) + n * value
            counts[name] = counts.get(name, 0) + n
    return {name: sums[name] / counts[name] for name in sums if counts[name]}
