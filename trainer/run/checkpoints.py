"""A run's checkpoints: writing one after a step, with what resuming needs beyond the weights
(the non-finite streak, the step's metrics, the latest ``checkpoint.keep_best_by`` value the
retention rule ranks by), and restoring one before the first step
(:mod:`trainer.checkpoint.store` reads and writes the folders)."""

from __future__ import annotations

import math
from pathlib import Path

from jobspec.checkpoint_files import SHARDED_DIR
from trainer.checkpoint.sharded import load_sharded, save_sharded
from trainer.checkpoint.store import (
    RETENTION_METRIC,
    checkpoint_path,
    load_checkpoint,
    new_temp_dir,
    save_checkpoint,
)
from trainer.data.dataset import SamplerState
from trainer.run.setup import RunSetup

__all__ = ["RunCheckpoints"]


class RunCheckpoints:
    def __init__(self, setup: RunSetup) -> None:
        self.setup = setup
        # checkpoint.keep_best_by's latest value so far (what the retention rule ranks by).
        self.best_by_value: float | None = None

    def restore(self, path: Path) -> tuple[int, dict[str, float]]:
        """Load a checkpoint into the policy, optimizer, scheduler, RNGs and data sampler; its
        step and metrics."""
        s = self.setup
        if s.mirror is None:
            state = load_checkpoint(Path(path), s.model, s.optimizer, s.scheduler)
        else:
            # Several ranks: each reads the Hugging Face weights into its unsharded mirror,
            # then its shards of the weights and optimizer state (DCP reshards them when the
            # checkpoint was written by another number of ranks).
            state = load_checkpoint(Path(path), s.mirror.model, None, s.scheduler)
            with s.world.phase("restore"):
                load_sharded(Path(path) / SHARDED_DIR, s.model, s.optimizer)
        s.sampler.restore(SamplerState.from_dict(state.sampler))
        s.guard.streak = int(state.extra.get("nonfinite_streak", 0))
        best_by = state.extra.get(RETENTION_METRIC)
        if isinstance(best_by, dict) and best_by.get("name") == s.config.checkpoint.keep_best_by:
            value = best_by.get("value")
            self.best_by_value = float(value) if isinstance(value, int | float) else None
        return state.step, dict(state.extra.get("metrics", {}))

    def track(self, metrics: dict[str, float]) -> None:
        """Note a step's value of ``checkpoint.keep_best_by`` (a finite one)."""
        name = self.setup.config.checkpoint.keep_best_by
        if name is not None and name in metrics and math.isfinite(metrics[name]):
            self.best_by_value = float(metrics[name])

    def save(self, step: int, metrics: dict[str, float]) -> Path:
        """Write the checkpoint of ``step``, then apply the spec's checkpoint retention, unless
        the callbacks apply it themselves (the service's worker: its records must agree with
        the disk, so it alone deletes)."""
        s = self.setup
        retention = s.config.checkpoint
        extra: dict[str, object] = {"nonfinite_streak": s.guard.streak, "metrics": metrics}
        if retention.keep_best_by is not None:
            extra[RETENTION_METRIC] = {"name": retention.keep_best_by, "value": self.best_by_value}
        temp_dir = None
        if s.mirror is not None:
            # Every rank writes its shards into the folder rank 0 opened; rank 0 then adds the
            # Hugging Face weights (from its mirror) and the rest, and renames it complete.
            s.mirror.ensure_fresh(s.model)
            opened = new_temp_dir(s.output_dir, step) if s.world.is_main else None
            temp_dir = s.world.broadcast_object(opened, "checkpoint")
            assert temp_dir is not None
            with s.world.phase("checkpoint"):
                save_sharded(temp_dir / SHARDED_DIR, s.model, s.optimizer)
            if not s.world.is_main:
                s.world.barrier("checkpoint")
                return checkpoint_path(s.output_dir, step)
        path = save_checkpoint(
            s.output_dir,
            step,
            model=s.rollout_model,
            tokenizer=s.tokenizer,
            optimizer=s.optimizer,
            scheduler=s.scheduler,
            sampler=s.sampler.state().to_dict(),
            extra=extra,
            retention=None if s.callbacks.applies_retention else retention,
            temp_dir=temp_dir,
        )
        s.world.barrier("checkpoint")  # the other ranks go on once the folder is complete
        s.callbacks.on_checkpoint(step, path)
        return path
