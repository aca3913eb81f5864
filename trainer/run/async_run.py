"""What an asynchronous run (``grpo.async.max_staleness`` K >= 1) adds to the loop: its rollout
server, the producer that fills steps ahead (:mod:`trainer.run.async_rollouts`), the weights
published as versions, the batches a checkpoint keeps, the step's async metrics and the
mismatch guard.

Per step ``t`` the loop calls, in order: :meth:`AsyncRollouts.collect` (step ``t``'s batch,
generated with version ``max(0, t-1-K)``), the update (whose engine sync writes version ``t``
to the server's files, :class:`trainer.rollout.remote_engine.RemoteEngine`),
:meth:`AsyncRollouts.finish_step` (version ``t`` published even when no update ran, the async
metrics, the guard), :meth:`AsyncRollouts.checkpoint_state` when it writes a checkpoint, then
:meth:`AsyncRollouts.release` (the producer may sample with version ``t``).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from trainer.errors import TrainerError
from trainer.rollout.base import RolloutEngine
from trainer.rollout.startup import StartedEngine
from trainer.run.async_rollouts import (
    RolloutPipeline,
    behaviour_version,
    drop_stale,
    pending_from_json,
    pending_to_json,
    staleness_metrics,
)
from trainer.scoring.collect import Collected, collect_groups
from trainer.scoring.sampling import Rollout

if TYPE_CHECKING:
    from trainer.rollout.remote_engine import RemoteEngine
    from trainer.run.setup import RunSetup

__all__ = [
    "PENDING_KEY",
    "AsyncRollouts",
    "async_refusal",
    "mismatch_guard",
    "server_threads",
]

# Where a checkpoint's manifest keeps the batches made ahead (``extra``).
PENDING_KEY = "async_pending"
MISMATCH_METRIC = "mismatch/token_mult_prob_error"


def async_refusal(setup: RunSetup) -> str | None:
    """Why this run cannot roll out asynchronously (None: it can)."""
    if setup.world.distributed or setup.shares > 1:
        return "grpo.async with several devices is not supported yet: use resources.devices 1"
    if setup.given_engine is not None:
        return "grpo.async needs the run's own rollout server, not a given engine"
    if setup.model_path is None:
        return "grpo.async needs the model loaded from its folder (config.model)"
    return None


def server_threads(device_type: str) -> int | None:
    """The rollout server's CPU threads when the spec leaves them unset: on a CPU worker half
    its cores (the trainer keeps the rest: the two run side by side), elsewhere the server's
    own choice (None; it generates on its device)."""
    if device_type != "cpu":
        return None
    return max(1, len(os.sched_getaffinity(0)) // 2)


def mismatch_guard(metrics: dict[str, float], bound: float) -> str | None:
    """The reason to pause when the step's sampler/trainer mismatch passes ``bound``."""
    value = metrics.get(MISMATCH_METRIC)
    if value is None or value <= bound:
        return None
    return (
        f"paused by the mismatch guard: {MISMATCH_METRIC} {value:.4f} > "
        f"grpo.async.max_mismatch {bound} (the samples are too far off the trainer's policy; "
        "lower the learning rate or max_staleness, then resume)"
    )


class AsyncRollouts:
    """The rollout server and producer of one asynchronous run."""

    def __init__(self, setup: RunSetup, rollout: Rollout, seed: int) -> None:
        refusal = async_refusal(setup)
        if refusal is not None:
            raise TrainerError(refusal, reason="unsupported")
        from trainer.rollout.remote_start import start_remote_engine

        self.setup = setup
        self.rollout = rollout
        self.seed = seed
        self.k = setup.config.grpo.async_.max_staleness
        threads = setup.config.grpo.async_.server_threads or server_threads(setup.device.type)
        self.engine: RemoteEngine = start_remote_engine(setup, threads=threads)
        self.started = StartedEngine(self.engine, None, owned=True)
        self.pipeline: RolloutPipeline | None = None
        self._clock = time.perf_counter()
        self._busy = 0.0
        self._update_seconds = 0.0
        self._dropped = 0

    # ------------------------------------------------------------------ start and end

    def open(self, start_step: int, restored_extra: dict[str, Any] | None) -> float:
        """Publish the starting weights as version ``start_step`` and start the producer
        (with the batches the checkpoint kept, when resuming); seconds the weights took."""
        self.engine.publish_version = start_step
        seconds = self.engine.sync_weights(self.setup.model)
        pending = pending_from_json((restored_extra or {}).get(PENDING_KEY) or {})
        self.pipeline = RolloutPipeline(
            self._produce,
            max_staleness=self.k,
            first_step=start_step + 1,
            last_step=self.setup.config.grpo.steps,
            published=start_step,
            pending=pending,
        )
        self.pipeline.start()
        self._clock = time.perf_counter()
        return seconds

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.stop(timeout=0.0)
        self.engine.close()
        if self.pipeline is not None:
            self.pipeline.stop()
            self.pipeline = None

    def _produce(self, step: int, version: int) -> Collected:
        s = self.setup
        return collect_groups(
            self.engine.at_version(version),
            s.scorer,
            s.sampler,
            s.train_ids,
            s.train_rows,
            s.config.grpo,
            seed=self.seed,
            step=step,
            # A step made ahead samples every round it may: stopping is the loop's (between
            # steps), and a batch's content must not depend on when a stop was asked.
            should_stop=lambda: False,
            world=s.world,
            shares=s.shares,
            rollout=self.rollout,
        )

    # ------------------------------------------------------------------ one step

    def eval_engine(self, step: int) -> RolloutEngine:
        """The engine evaluation uses after step ``step``: the server at version ``step``."""
        return self.engine.at_version(step)

    def collect(self, step: int) -> tuple[Collected, dict[str, float]]:
        """Step ``step``'s batch, with stale samples dropped, and its async metrics."""
        assert self.pipeline is not None
        collected, waited = self.pipeline.take(step)
        dropped = drop_stale(collected, step, self.k)
        self._dropped += dropped
        metrics = staleness_metrics(collected, step, self.k)
        metrics["async/dropped_stale"] = float(dropped)
        metrics["async/behaviour_version"] = float(behaviour_version(step, self.k))
        metrics["time/wait_for_rollouts"] = waited
        return collected, metrics

    def finish_step(self, step: int, metrics: dict[str, float]) -> str | None:
        """After step ``step``'s update: version ``step`` published to the server's files (the
        update's sync wrote it unless no update ran), the busy fractions since the last step,
        the restart count; the guard's pause reason, if any."""
        if self.engine.publish_version <= step:
            self.engine.publish_version = step
            metrics["time/weight_sync"] = metrics.get("time/weight_sync", 0.0) + (
                self.engine.sync_weights(self.setup.model)
            )
        assert self.pipeline is not None
        now = time.perf_counter()
        wall = max(now - self._clock, 1e-9)
        busy = self.pipeline.busy_seconds()
        update = metrics.get("time/update", 0.0) + metrics.get("time/logprobs", 0.0)
        metrics["async/rollout_busy_frac"] = min(1.0, (busy - self._busy) / wall)
        metrics["async/update_busy_frac"] = min(1.0, update / wall)
        metrics["rollout/server_restarts"] = float(self.engine.restarts)
        self._clock, self._busy = now, busy
        return mismatch_guard(metrics, self.setup.config.grpo.async_.max_mismatch)

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """What step ``step``'s checkpoint keeps beyond the weights: the batches made ahead.
        Waits for the producer to settle, so the data sampler's position saved with them is
        the one after them."""
        assert self.pipeline is not None
        return {PENDING_KEY: pending_to_json(self.pipeline.settle(step))}

    def release(self, step: int) -> None:
        """Step ``step`` is done (and checkpointed, if it was to be): sample with its weights."""
        assert self.pipeline is not None
        self.pipeline.publish(step)
        self.engine.forget_versions_below(max(0, step - self.k))
