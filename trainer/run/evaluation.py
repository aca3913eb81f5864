"""The held-out evaluation of a run at a step: greedy completions of the eval prompts, scored,
announced as an ``eval`` event; on several ranks each evaluates its share of the rows and the
accuracies are combined by row count (accuracy is a mean over rows, so the combination is the
one-process value)."""

from __future__ import annotations

from trainer.distributed.world import World
from trainer.rollout.base import RolloutEngine
from trainer.run.metrics import evaluate
from trainer.run.setup import RunSetup
from trainer.scoring.sampling import Rollout
from trainer.seeding import derive_seed

__all__ = ["evaluate_run"]

_EVAL_SEED_SALT = 99_991


def evaluate_run(
    setup: RunSetup,
    engine: RolloutEngine,
    step: int,
    rollout: Rollout | None = None,
    *,
    world: World | None = None,
) -> float:
    """``eval/accuracy`` of the run at ``step`` (0: before any update); with an agent job's
    ``rollout``, of greedy episodes. ``world``: the ranks that evaluate, each its share
    (default: the run's; an async job's rank 0 evaluates every row alone)."""
    s = setup
    world = world or s.world
    rows = s.eval_rows[: len(s.eval_ids)]
    share = world.share(len(rows))
    seed = derive_seed(s.config.seed, step, _EVAL_SEED_SALT)
    items = [row.grading_item for row in rows[share.start : share.stop]]
    ids = s.eval_ids[share.start : share.stop]
    episodes = None if rollout is None else (rollout, rows[share.start : share.stop])
    mine = (
        evaluate(engine, s.scorer, ids, items, s.config.grpo, seed=seed, rollout=episodes)
        if ids
        else 0.0
    )
    parts = world.gather_objects((mine, len(ids)), "eval")
    accuracy = sum(a * n for a, n in parts) / max(1, sum(n for _, n in parts))
    s.callbacks.on_event(
        "eval",
        f"step {step}: eval accuracy {accuracy:.3f} on {len(rows)} rows",
        data={"step": step, "accuracy": accuracy, "rows": len(rows)},
    )
    return accuracy
