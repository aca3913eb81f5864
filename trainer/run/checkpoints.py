"""A run's checkpoints: writing one after a step, with what resuming needs beyond the weights
(the non-finite streak, the step's metrics, the latest ``checkpoint.keep_best_by`` value the
retention rule ranks by), and restoring one before the first step
(:mod:`trainer.checkpoint.store` reads and writes the folders)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.checkpoint.store import (
    RETENTION_METRIC,
    checkpoint_path,
    load_checkpoint,
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
            # Sharded: every rank reads the folder into its unsharded mirror, then takes its
            # shards of the weights and of the optimizer state (keyed by parameter name).
            state = load_checkpoint(
                Path(path), s.mirror.model, None, s.scheduler, optimizer_keyed_by_name=True
            )
            with s.world.phase("restore"):
                set_model_state_dict(s.model, s.mirror.model.state_dict(), options=_FULL)
                set_optimizer_state_dict(
                    s.model, s.optimizer, optim_state_dict=state.optimizer or {}, options=_FULL
                )
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
        optimizer_state: dict[str, Any] | None = None
        if s.mirror is not None:
            # Every rank gathers (collectives); rank 0 alone writes, in the same format a
            # single process writes but with the optimizer state keyed by parameter name,
            # which any number of ranks can read back.
            s.mirror.ensure_fresh(s.model)
            with s.world.phase("checkpoint"):
                optimizer_state = get_optimizer_state_dict(
                    s.model, s.optimizer, options=_FULL_ON_MAIN
                )
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
            optimizer_state=optimizer_state,
        )
        s.world.barrier("checkpoint")  # the other ranks go on once the folder is complete
        s.callbacks.on_checkpoint(step, path)
        return path


_FULL = StateDictOptions(full_state_dict=True)
_FULL_ON_MAIN = StateDictOptions(full_state_dict=True, cpu_offload=True)
