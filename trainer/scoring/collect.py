"""Rollout collection for one step: sample G completions per prompt, grade them, and (with DAPO
dynamic sampling) drop groups whose rewards are all equal and sample more prompts to refill.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from jobspec import GRPOSpec
from trainer.data.dataset import Example, PromptSampler
from trainer.distributed.world import World
from trainer.models.memory import release_free_memory
from trainer.rollout.base import Completion, RolloutEngine
from trainer.scoring.rewards import Scorer, score_batch
from trainer.scoring.sampling import Rolled, Rollout, SingleTurn
from trainer.seeding import derive_seed

__all__ = ["Collected", "Group", "collect_groups", "prompts_for_round", "zero_variance_groups"]


def zero_variance_groups(rewards: Tensor, tol: float = 1e-6) -> Tensor:
    """Bool [N_groups]: True where the group's rewards are all equal (population std < tol).

    Such groups give zero advantage and so no policy-gradient signal; dynamic sampling drops
    them and samples more prompts.
    """
    r = rewards.detach().double()
    return r.std(dim=1, unbiased=False) < tol


@dataclass
class Group:
    """One prompt and its G graded completions."""

    row: int  # index into the training rows
    prompt_ids: list[int]
    completions: list[Completion]
    rewards: list[float]  # [G] total task reward (weighted grader sum)
    per_grader: dict[str, list[float]]  # scorer name -> [G] unweighted scores
    zero_std: bool  # all rewards equal: no learning signal
    # [G] each completion's own prompt (agent episodes); None: ``prompt_ids`` for all
    prompts: list[list[int]] | None = None
    # [G] each episode's transcript for the rollout viewer (Rolled.transcripts); None: single
    # completions
    transcripts: list[dict[str, Any]] | None = None

    def prompt_of(self, j: int) -> list[int]:
        """Completion ``j``'s prompt ids."""
        return self.prompt_ids if self.prompts is None else self.prompts[j]


@dataclass
class Collected:
    groups: list[Group] = field(default_factory=list)  # every group sampled this step
    kept: list[Group] = field(default_factory=list)  # the groups to train on
    rounds: int = 0
    rollout_seconds: float = 0.0
    reward_seconds: float = 0.0
    generated_tokens: int = 0
    stop_requested: bool = False  # should_stop() said so between rounds
    # scorer name -> failed calls over every round (scored 0: raised, bad value, timed out)
    grader_errors: dict[str, int] = field(default_factory=dict)
    # scorer name -> its first error message of the step (graders that keep one: user code)
    grader_messages: dict[str, str] = field(default_factory=dict)
    grader_timeouts: dict[str, int] = field(default_factory=dict)  # of which ran out of time
    # (episodes, mean metrics) of each batch of agent episodes (trainer.scoring.sampling)
    rollout_metrics: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    @property
    def num_zero_std(self) -> int:
        return sum(g.zero_std for g in self.groups)


def prompts_for_round(shortfall: int, *, sampled: int, kept: int, oversample: float) -> int:
    """How many prompts a sampling round draws to fill ``shortfall`` missing groups.

    The first round (nothing sampled yet) draws the shortfall. A later one divides it by the
    share of groups kept so far (the best guess of the next round's keep rate), so that one
    round usually suffices, but never more than ``oversample`` times the shortfall: with a
    keep rate of 1/4 and oversample 2, 4 missing groups draw 8 prompts, not 16.
    """
    if shortfall <= 0:
        return 0
    if sampled == 0:
        return shortfall
    keep_rate = kept / sampled
    wanted = math.ceil(shortfall / keep_rate) if keep_rate > 0 else math.inf
    return int(min(wanted, math.ceil(shortfall * oversample)))


def collect_groups(
    engine: RolloutEngine,
    scorer: Scorer,
    sampler: PromptSampler,
    prompt_ids: Sequence[list[int]],
    examples: Sequence[Example],
    spec: GRPOSpec,
    *,
    seed: int,
    step: int,
    should_stop: Callable[[], bool],
    world: World | None = None,
    shares: int = 1,
    rollout: Rollout | None = None,
) -> Collected:
    """Sample ``spec.prompts_per_step`` groups for step ``step`` with ``rollout`` (default
    :class:`SingleTurn`; agent jobs: ``trainer.run.episodes``) and score them with ``scorer``.

    Each round's prompts are split into ``shares`` contiguous shares (the job's
    ``resources.devices``); share k of round r of step s samples with the engine seed
    ``derive_seed(seed, s, r, k)`` (``derive_seed(seed, s, r)`` when there is one share), so
    a job's samples depend on its spec, not on how many ranks run it. In a distributed
    ``world`` (as many ranks as shares) each rank samples and scores its own share and the
    rounds' groups are gathered, so every rank returns the same :class:`Collected`; a
    single process samples every share itself.

    Without dynamic sampling every group is kept. With it, zero-variance groups (judged on the
    task reward, the canonical signal, not on shaped rewards) are dropped and more prompts are
    sampled, for at most ``max_rounds`` rounds: :func:`prompts_for_round` many, so that one
    more round usually fills the batch. Kept groups past the target are left out of ``kept``
    (they still count in ``groups``, as sampled); the batch may end up smaller than asked."""
    world = world or World()
    if world.distributed and world.size != shares:
        raise ValueError(f"{world.size} ranks cannot sample a job of {shares} devices")
    target = spec.prompts_per_step
    dynamic = spec.dynamic_sampling.enabled
    rounds = spec.dynamic_sampling.max_rounds if dynamic else 1
    out = Collected()
    for rnd in range(rounds):
        if rnd > 0 and should_stop():
            out.stop_requested = True
            break
        need = prompts_for_round(
            target - len(out.kept),
            sampled=len(out.groups),
            kept=len(out.kept),
            oversample=spec.dynamic_sampling.oversample,
        )
        rows = sampler.next(need)
        reports = [
            _sample_share(
                engine,
                rollout or SingleTurn(),
                scorer,
                [rows[i] for i in World(rank=share, size=shares).share(len(rows))],
                prompt_ids,
                examples,
                spec,
                seed=derive_seed(seed, step, rnd, share)
                if shares > 1
                else derive_seed(seed, step, rnd),
            )
            for share in ([world.rank] if world.distributed else range(shares))
        ]
        if world.distributed:
            reports = world.gather_objects(reports[0], "collect")
        out.rounds += 1
        for report in reports:
            report.add_to(out)
        # Shares sampled side by side on several ranks: the round took as long as the slowest.
        spent = [(r.rollout_seconds, r.reward_seconds) for r in reports]
        combine = max if world.distributed else sum
        out.rollout_seconds += combine(s[0] for s in spent)
        out.reward_seconds += combine(s[1] for s in spent)
        for group in (g for report in reports for g in report.groups):
            if not (dynamic and group.zero_std) and len(out.kept) < target:
                out.kept.append(group)
        if len(out.kept) >= target:
            break
    return out


@dataclass
class _ShareReport:
    """One share of one round: its groups and what sampling and scoring them took."""

    groups: list[Group]
    rollout_seconds: float
    reward_seconds: float
    generated_tokens: int
    grader_errors: dict[str, int]
    grader_messages: dict[str, str]
    grader_timeouts: dict[str, int]
    rollout_metrics: list[tuple[int, dict[str, float]]]

    def add_to(self, out: Collected) -> None:
        """Add the share's groups and counts (not its seconds: see collect_groups)."""
        out.groups.extend(self.groups)
        out.generated_tokens += self.generated_tokens
        for name, count in self.grader_errors.items():
            out.grader_errors[name] = out.grader_errors.get(name, 0) + count
        for name, message in self.grader_messages.items():
            out.grader_messages.setdefault(name, message)
        for name, count in self.grader_timeouts.items():
            out.grader_timeouts[name] = out.grader_timeouts.get(name, 0) + count
        out.rollout_metrics.extend(self.rollout_metrics)


def _sample_share(
    engine: RolloutEngine,
    rollout: Rollout,
    scorer: Scorer,
    rows: list[int],
    prompt_ids: Sequence[list[int]],
    examples: Sequence[Example],
    spec: GRPOSpec,
    *,
    seed: int,
) -> _ShareReport:
    """Sample ``spec.group_size`` completions for each of ``rows`` with ``seed`` and grade
    them."""
    g = spec.group_size
    report = _ShareReport([], 0.0, 0.0, 0, {}, {}, {}, [])
    if not rows:
        return report
    started = time.perf_counter()
    rolled = rollout.sample(
        engine,
        [prompt_ids[r] for r in rows],
        [examples[r] for r in rows],
        g,
        spec,
        seed=seed,
    )
    results = rolled.completions
    report.rollout_seconds = time.perf_counter() - started
    report.rollout_metrics = list(rolled.metrics)
    release_free_memory()  # the engine's temporaries, before the trainer's passes
    started = time.perf_counter()
    items = [examples[r].grading_item for r in rows for _ in range(g)]
    totals, per_grader = _score(scorer, rolled, items, report)
    zero = zero_variance_groups(torch.tensor(totals, dtype=torch.float64).view(len(rows), -1))
    report.reward_seconds = time.perf_counter() - started
    for i, (row, comps) in enumerate(zip(rows, results, strict=True)):
        report.generated_tokens += sum(
            len(c.token_ids) if c.loss_mask is None else sum(c.loss_mask) for c in comps
        )
        report.groups.append(
            Group(
                row=row,
                prompt_ids=list(prompt_ids[row]),
                completions=list(comps),
                rewards=totals[i * g : (i + 1) * g],
                per_grader={name: s[i * g : (i + 1) * g] for name, s in per_grader.items()},
                zero_std=bool(zero[i]),
                prompts=None if rolled.prompts is None else rolled.prompts[i],
                transcripts=None
                if rolled.transcripts is None
                else rolled.transcripts[i * g : (i + 1) * g],
            )
        )
    return report


def _score(
    scorer: Scorer, rolled: Rolled, items: list[Mapping[str, Any]], report: _ShareReport
) -> tuple[list[float], dict[str, list[float]]]:
    """The graders' totals and components, plus the rollout's extra rewards (weighted)."""
    texts = rolled.texts
    if texts is None:
        texts = [c.text for group in rolled.completions for c in group]
    scored = score_batch(scorer, texts, items)
    totals, per_grader = list(scored.totals), dict(scored.components)
    report.grader_errors = dict(scored.errors)
    report.grader_messages = dict(scored.first_errors)
    report.grader_timeouts = dict(scored.timeouts)
    for name, (weight, values) in rolled.extra_rewards.items():
        per_grader[name] = list(values)
        totals = [t + weight * v for t, v in zip(totals, values, strict=True)]
    return totals, per_grader
