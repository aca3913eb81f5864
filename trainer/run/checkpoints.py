"""A run's checkpoints: writing one after a step, with what resuming needs beyond the weights
(the non-finite streak, the step's metrics, the latest ``checkpoint.keep_best_by`` value the
retention rule ranks by, the run's ``grpo.async.max_staleness``), and restoring one before the
first step (:mod:`trainer.checkpoint.store` reads and writes the folders).

A resume runs the spec it is given, which may differ from the one that wrote the checkpoint
in what a paused job may change (the service's ``POST /v1/jobs/{id}/resume`` with ``set``):
``grpo.learning_rate`` and ``grpo.steps`` apply from the first step after the checkpoint (the
schedule's state keeps its position, not its rate), and another ``max_staleness`` samples the
batches made ahead again (:func:`trainer.run.async_rollouts.plan_resume`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

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
from trainer.distributed.timeout import checkpoint_timeout_s
from trainer.distributed.world import PatientGroup
from trainer.errors import TrainerError
from trainer.run.async_rollouts import (
    PENDING_KEY,
    SAMPLER_BEFORE_KEY,
    STALENESS_KEY,
    plan_resume,
)
from trainer.run.setup import RunSetup

__all__ = ["RunCheckpoints", "checkpoint_bytes", "folder_bytes"]


class RunCheckpoints:
    def __init__(self, setup: RunSetup) -> None:
        self.setup = setup
        # checkpoint.keep_best_by's latest value so far (what the retention rule ranks by).
        self.best_by_value: float | None = None
        # The restored checkpoint's ``extra`` (what callers stored with ``extra_state``).
        self.restored_extra: dict[str, Any] = {}

    def restore(self, path: Path) -> tuple[int, dict[str, float]]:
        """Load a checkpoint into the policy, optimizer, scheduler, RNGs and data sampler; its
        step and metrics."""
        s = self.setup
        if s.mirror is None:
            state = load_checkpoint(Path(path), s.model, s.optimizer, s.scheduler)
        else:
            # Several ranks: each reads its shards of the weights and optimizer state (DCP
            # reshards them when the checkpoint was written by another number of ranks), its
            # collectives waiting for the slowest rank's reads as long as the checkpoint's size
            # needs. No rank reads the whole Hugging Face weights: the mirror is refreshed from
            # the shards when something next needs it.
            timeout = checkpoint_timeout_s(s.world.timeout_s, folder_bytes(Path(path)))
            with s.world.patient_group(timeout) as patient:
                state = load_checkpoint(Path(path), s.model, None, s.scheduler, weights=False)
                with s.world.phase("restore"):
                    load_sharded(Path(path) / SHARDED_DIR, s.model, s.optimizer, _group(patient))
            s.mirror.mark_stale()
        s.sampler.restore(SamplerState.from_dict(state.sampler))
        self.restored_extra = self._planned(dict(state.extra), state.step)
        self._apply_learning_rate()
        s.guard.streak = int(state.extra.get("nonfinite_streak", 0))
        best_by = state.extra.get(RETENTION_METRIC)
        if isinstance(best_by, dict) and best_by.get("name") == s.config.checkpoint.keep_best_by:
            value = best_by.get("value")
            self.best_by_value = float(value) if isinstance(value, int | float) else None
        return state.step, dict(state.extra.get("metrics", {}))

    def _planned(self, extra: dict[str, Any], step: int) -> dict[str, Any]:
        """``extra`` with the batches made ahead as this run's K takes them: kept, or dropped
        and the data sampler rewound to before them (a resume event says so); refused with
        the reason when neither is possible."""
        s = self.setup
        try:
            plan = plan_resume(extra, step=step, max_staleness=s.config.grpo.async_.max_staleness)
        except ValueError as refused:
            raise TrainerError(str(refused), reason="resume_refused") from None
        if plan.rewind_to is not None:
            s.sampler.restore(SamplerState.from_dict(plan.rewind_to))
        if plan.note is not None and s.world.is_main:
            s.callbacks.on_event("resume", plan.note, "warning")
        return {**extra, PENDING_KEY: plan.pending, SAMPLER_BEFORE_KEY: plan.sampler_before}

    def _apply_learning_rate(self) -> None:
        """The spec's ``grpo.learning_rate`` and schedule at the restored position: the
        restored scheduler and optimizer hold the rate the checkpoint was written with, which
        a resume may have changed (unchanged, this recomputes the same value)."""
        s = self.setup
        lambdas = getattr(s.scheduler, "lr_lambdas", None)
        if lambdas is None:
            return
        rate = s.config.grpo.learning_rate
        s.scheduler.base_lrs = [rate] * len(s.scheduler.base_lrs)
        for group, factor in zip(s.optimizer.param_groups, lambdas, strict=True):
            group["initial_lr"] = rate
            group["lr"] = rate * factor(s.scheduler.last_epoch)

    def track(self, metrics: dict[str, float]) -> None:
        """Note a step's value of ``checkpoint.keep_best_by`` (a finite one)."""
        name = self.setup.config.checkpoint.keep_best_by
        if name is not None and name in metrics and math.isfinite(metrics[name]):
            self.best_by_value = float(metrics[name])

    def save(
        self, step: int, metrics: dict[str, float], extra_state: dict[str, Any] | None = None
    ) -> Path:
        """Write the checkpoint of ``step``, then apply the spec's checkpoint retention, unless
        the callbacks apply it themselves (the service's worker: its records must agree with
        the disk, so it alone deletes). ``extra_state``: JSON-ready entries the manifest keeps
        beside the trainer's own (an async run's batches made ahead), back in
        ``restored_extra`` after :meth:`restore`."""
        s = self.setup
        retention = s.config.checkpoint
        extra: dict[str, object] = {
            **(extra_state or {}),
            # What a resume with another K compares against (plan_resume).
            STALENESS_KEY: s.config.grpo.async_.max_staleness,
            "nonfinite_streak": s.guard.streak,
            "metrics": metrics,
        }
        if retention.keep_best_by is not None:
            extra[RETENTION_METRIC] = {"name": retention.keep_best_by, "value": self.best_by_value}
        if s.mirror is None:
            path = self._write(step, extra, temp_dir=None)
        else:
            path = self._write_on_every_rank(step, extra)
            if not s.world.is_main:
                return path
        s.callbacks.on_checkpoint(step, path)
        return path

    def _write_on_every_rank(self, step: int, extra: dict[str, object]) -> Path:
        """Every rank writes its shards into the folder rank 0 opened; rank 0 then adds the
        Hugging Face weights (from its mirror) and the rest, and renames it complete, while the
        others wait at the barrier. Both waits are bounded by the checkpoint's size
        (:func:`checkpoint_timeout_s`), not the world's timeout a large model's write outlasts;
        the folder's path on every rank."""
        s = self.setup
        assert s.mirror is not None
        # Rank 0 writes the whole weights; the others only take part in the gathers (a lazy
        # mirror stays a skeleton there: no host copy on every rank of a node).
        s.mirror.gather_for_main(s.model)
        opened = new_temp_dir(s.output_dir, step) if s.world.is_main else None
        temp_dir = s.world.broadcast_object(opened, "checkpoint")
        assert temp_dir is not None
        timeout = checkpoint_timeout_s(s.world.timeout_s, checkpoint_bytes(s.model, s.optimizer))
        with s.world.patient_group(timeout) as patient:
            with s.world.phase("checkpoint"):
                save_sharded(temp_dir / SHARDED_DIR, s.model, s.optimizer, _group(patient))
            path = checkpoint_path(s.output_dir, step)
            if s.world.is_main:
                path = self._write(step, extra, temp_dir=temp_dir)
            s.world.barrier("checkpoint", patient)  # the others go on once the folder is complete
        return path

    def _write(self, step: int, extra: dict[str, object], temp_dir: Path | None) -> Path:
        """Rank 0's part: the weights the engine reads, the tokenizer, the optimizer (unless
        sharded), RNGs and manifest, renamed complete; retention applied unless the callbacks
        apply it."""
        s = self.setup
        retention = s.config.checkpoint
        return save_checkpoint(
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


def _group(patient: PatientGroup | None) -> Any:
    """The process group of a patient wait (None: the default group)."""
    return None if patient is None else patient.group


def checkpoint_bytes(model: nn.Module, optimizer: Optimizer) -> int:
    """What a multi-rank checkpoint writes, in bytes, over every rank: the trainable
    parameters twice (the ranks' shards, then rank 0's Hugging Face weights) and the optimizer
    state (Adam: two moments per parameter). Sizes are global: a sharded tensor counts whole."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    weights = sum(_tensor_bytes(p) for p in params.values())
    state = sum(
        _tensor_bytes(value)
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    )
    return 2 * weights + state


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def folder_bytes(folder: Path) -> int:
    """The size of every file under ``folder``: what a restore reads."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
