"""A run's checkpoints: writing one after a step, with what resuming needs beyond the weights
(the non-finite streak, the step's metrics, the latest ``checkpoint.keep_best_by`` value the
retention rule ranks by), and restoring one before the first step
(:mod:`trainer.checkpoint.store` reads and writes the folders)."""

from __future__ import annotations

import math
from pathlib import Path

from trainer.checkpoint.store import RETENTION_METRIC, load_checkpoint, save_checkpoint
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
        state = load_checkpoint(Path(path), s.model, s.optimizer, s.scheduler)
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
        path = save_checkpoint(
            s.output_dir,
            step,
            model=s.model,
            tokenizer=s.tokenizer,
            optimizer=s.optimizer,
            scheduler=s.scheduler,
            sampler=s.sampler.state().to_dict(),
            extra=extra,
            retention=None if s.callbacks.applies_retention else retention,
        )
        s.callbacks.on_checkpoint(step, path)
        return path
