"""A step's batch across the job's ranks: which kept groups train, which of them are this
rank's, and the step's values that must be whole-batch (advantages, metrics).

The kept groups are cut to a multiple of the job's devices (so that every rank trains an equal
share and runs as many passes as its peers: FSDP's collectives pair up pass for pass); the cut
is the job's, made the same way when one process runs it. Every rank knows every kept group
(``collect_groups`` gathers them), so advantages, which a batch-wide scale or a group's
leave-one-out baseline make whole-batch or whole-group values, are computed over all of them
and each rank takes its rows; only the reward KL penalty, which needs the ranks' own
log-probabilities, is gathered.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field

import torch
from torch import Tensor

from jobspec import GRPOSpec
from trainer.distributed.world import World
from trainer.run.metrics import update_metrics, update_step_metrics
from trainer.scoring.collect import Group
from trainer.update.batch import Batch
from trainer.update.inputs import Scored, pack_groups
from trainer.update.policy_update import PreUpdate, UpdateStats

__all__ = [
    "RankBatch",
    "gather_rows",
    "rank_batch",
    "rank_figures",
    "rank_update_metrics",
    "trained_tokens",
    "whole_metrics",
]


@dataclass
class RankBatch:
    kept: list[Group]  # the groups the step trains on, every rank's, in order
    left_out: int  # kept groups cut so that the devices share them evenly
    whole: Batch  # ``kept`` then ``kl_only``, packed (advantages are computed on it)
    batch: Batch  # this rank's rows of it (``whole`` itself on a single rank)
    rows: Tensor  # where this rank's rows sit in ``whole`` ([B_rank] indices, in its order)
    kl_only: list[Group] = field(default_factory=list)  # groups only the KL acts on

    def mine(self, values: Tensor) -> Tensor:
        """This rank's entries of a whole-batch vector ([B_whole] -> [B_rank])."""
        return values[self.rows.to(values.device)]


def rank_batch(
    kept: list[Group],
    spec: GRPOSpec,
    device: torch.device,
    world: World,
    shares: int,
    kl_only: list[Group] | None = None,
) -> RankBatch:
    """The step's batch: the ``kept`` groups (the task's update) followed by the ``kl_only``
    groups (``trainer.update.inputs.kl_only_groups``), each list cut to a multiple of
    ``shares``; on several ranks each rank packs its share of each list."""
    groups = kept[: len(kept) - len(kept) % shares]
    extra = (kl_only or [])[: len(kl_only or []) - len(kl_only or []) % shares]
    whole = pack_groups([*groups, *extra], spec, device, task_groups=len(groups))
    if not world.distributed:
        every = torch.arange(whole.size)
        return RankBatch(groups, len(kept) - len(groups), whole, whole, every, extra)
    g = spec.group_size
    mine_kept, mine_extra = world.share(len(groups)), world.share(len(extra))
    rows = torch.cat(
        [
            torch.arange(mine_kept.start * g, mine_kept.stop * g),
            torch.arange((len(groups) + mine_extra.start) * g, (len(groups) + mine_extra.stop) * g),
        ]
    )
    batch = pack_groups(
        [*groups[mine_kept.start : mine_kept.stop], *extra[mine_extra.start : mine_extra.stop]],
        spec,
        device,
        task_groups=mine_kept.stop - mine_kept.start,
    )
    return RankBatch(groups, len(kept) - len(groups), whole, batch, rows, extra)


def trained_tokens(whole: Batch, spec: GRPOSpec) -> float:
    """``tokens/trained``: the batch's prompt and completion tokens, once per update pass over
    it (the OpenAI view's trained_tokens sums it over steps)."""
    lengths = sum(len(p) + len(c) for p, c in zip(whole.prompts, whole.completions, strict=True))
    return float(spec.num_iterations * lengths)


def gather_rows(world: World, rb: RankBatch, mine: Tensor, phase: str) -> Tensor:
    """Every rank's ``mine`` ([B_rank], the same length on every rank) put where its rows sit
    in the whole batch: [B_whole]."""
    if not world.distributed:
        return mine
    parts = world.gather_objects((rb.rows, mine.detach().cpu()), phase)
    whole = torch.zeros(rb.whole.size, dtype=mine.dtype)
    for rows, values in parts:
        whole[rows] = values
    return whole.to(mine.device)


def rank_update_metrics(
    world: World,
    rb: RankBatch,
    stats: UpdateStats,
    adv: Tensor,
    scored: Scored,
    pre: PreUpdate | None,
    spec: GRPOSpec,
) -> dict[str, float]:
    """The update's metrics over the whole batch: this rank's token-level ones averaged with
    its peers' (``adv`` is the whole batch's advantages; ``stats`` are summed already)."""
    local = update_step_metrics(stats, adv, rb.batch, scored, pre, spec)
    exact = set(update_metrics(stats, adv))
    return whole_metrics(world, local, float(rb.batch.mask.sum()), exact=exact)


def whole_metrics(
    world: World, metrics: dict[str, float], weight: float, *, exact: set[str]
) -> dict[str, float]:
    """One rank's update metrics made whole-batch: those in ``exact`` are already (summed
    statistics, the whole batch's advantages); every other one is a mean over this rank's
    tokens, averaged over the ranks by their ``weight`` (token count), except ``*max*``
    metrics, whose maximum is taken."""
    if not world.distributed:
        return metrics
    reports = world.gather_objects((metrics, weight), "metrics")
    total = sum(w for _, w in reports)
    out = dict(metrics)
    for name in metrics:
        if name in exact:
            continue
        values = [(m.get(name, float("nan")), w) for m, w in reports]
        if "max" in name:
            out[name] = max(v for v, _ in values)
        elif total > 0:
            out[name] = sum(v * w for v, w in values) / total
    return out


def rank_figures(world: World, step_seconds: float, device: torch.device) -> dict[str, float]:
    """Each rank's step time and peak memory (``rank/<r>/time_step``,
    ``rank/<r>/peak_memory_gib``: the device's peak allocation on CUDA, the process's peak
    resident size elsewhere); nothing on a single rank."""
    if not world.distributed:
        return {}
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    out: dict[str, float] = {}
    for rank, (seconds, gib) in enumerate(world.gather_objects((step_seconds, peak), "metrics")):
        out[f"rank/{rank}/time_step"] = float(seconds)
        out[f"rank/{rank}/peak_memory_gib"] = float(gib)
    return out
