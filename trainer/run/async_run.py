"""What an asynchronous run (``grpo.async.max_staleness`` K >= 1) adds to the loop: its rollout
server, the producer that fills steps ahead (:mod:`trainer.run.async_rollouts`), the weights
published as versions, the batches a checkpoint keeps, the step's async metrics and the
mismatch guard.

Several devices: a job has ONE rollout server and ONE producer, on rank 0. The producer samples
every share of each round itself (each with its share's seed, ``trainer.scoring.collect``), so
the batches are those the synchronous job of as many devices samples, and rank 0 broadcasts
each step's batch to the other ranks when the loop takes it (on the main thread, where every
collective of the step runs: the producer thread never calls the process group). The weights
are gathered on every rank as for a synchronous sync (``trainer.run.engine_sync``); rank 0
writes them as the version, the other ranks' :class:`GatherOnly` takes part in the gathers and
keeps nothing. Evaluation runs on rank 0's server and its accuracy is broadcast.

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
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer.distributed.world import World
from trainer.errors import TrainerError
from trainer.rollout.base import Completion, RolloutEngine
from trainer.rollout.startup import StartedEngine
from trainer.run.async_rollouts import (
    RolloutPipeline,
    behaviour_version,
    drop_stale,
    pending_from_json,
    pending_to_json,
    staleness_metrics,
)
from trainer.run.engine_sync import sync_engine
from trainer.run.evaluation import evaluate_run
from trainer.scoring.collect import Collected, collect_groups
from trainer.scoring.sampling import Rollout

if TYPE_CHECKING:
    from trainer.rollout.remote_engine import RemoteEngine
    from trainer.run.setup import RunSetup

__all__ = [
    "PENDING_KEY",
    "AsyncRollouts",
    "GatherOnly",
    "async_refusal",
    "mismatch_guard",
    "server_threads",
]

# Where a checkpoint's manifest keeps the batches made ahead (``extra``).
PENDING_KEY = "async_pending"
MISMATCH_METRIC = "mismatch/token_mult_prob_error"


def async_refusal(setup: RunSetup) -> str | None:
    """Why this run cannot roll out asynchronously (None: it can)."""
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


class GatherOnly:
    """A rank's side of the weight sync when the job's rollout server is rank 0's: it takes
    part in every gather (asks for every bucket, in order) and keeps nothing. Counts versions
    as the server's client does, so every rank agrees on whether a step published one."""

    def __init__(self) -> None:
        self.publish_version = 1

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        greedy: bool = False,
    ) -> list[list[Completion]]:
        raise TrainerError("only rank 0 rolls out in an async job", reason="unsupported")

    def sync_weights(self, model: nn.Module) -> float:
        self.publish_version += 1
        return 0.0

    def load_weight_buckets(
        self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], adapter_config: Any = None
    ) -> float:
        start = time.perf_counter()
        for _ in buckets:  # each bucket asked for runs its gathers
            pass
        self.publish_version += 1
        return time.perf_counter() - start

    def close(self) -> None:
        pass


class AsyncRollouts:
    """The rollout server and producer of one asynchronous run (rank 0's, on several ranks)."""

    def __init__(self, setup: RunSetup, rollout: Rollout, seed: int) -> None:
        refusal = async_refusal(setup)
        if refusal is not None:
            raise TrainerError(refusal, reason="unsupported")
        from trainer.rollout.remote_start import start_remote_engine

        self.setup = setup
        self.world: World = setup.world
        self.rollout = rollout
        self.seed = seed
        self.k = setup.config.grpo.async_.max_staleness
        # The engine the update's sync writes to: rank 0's server client, else a GatherOnly.
        self.server: RemoteEngine | None = None
        self.sink: RemoteEngine | GatherOnly
        if self.world.is_main:
            threads = setup.config.grpo.async_.server_threads or server_threads(setup.device.type)
            self.server = self.sink = start_remote_engine(setup, threads=threads)
        else:
            self.sink = GatherOnly()
        self.started = StartedEngine(self.sink, None, owned=True)
        self.pipeline: RolloutPipeline | None = None
        self._clock = time.perf_counter()
        self._busy = 0.0
        self._update_seconds = 0.0
        self._dropped = 0

    # ------------------------------------------------------------------ start and end

    @property
    def engine(self) -> RolloutEngine:
        """What the loop treats as its engine (rank 0: the server's client)."""
        return self.sink

    def open(self, start_step: int, restored_extra: dict[str, Any] | None) -> float:
        """Publish the starting weights as version ``start_step`` and start the producer
        (with the batches the checkpoint kept, when resuming); seconds the weights took."""
        self.sink.publish_version = start_step
        seconds = sync_engine(self.setup, self.sink)  # every rank: the gathers are collective
        if self.server is None:
            self._clock = time.perf_counter()
            return seconds
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
        self.sink.close()
        if self.pipeline is not None:
            self.pipeline.stop()
            self.pipeline = None

    def _produce(self, step: int, version: int) -> Collected:
        s = self.setup
        assert self.server is not None
        return collect_groups(
            self.server.at_version(version),
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
            # Every share sampled here, each with its own seed: the job's batch, on one rank.
            world=None,
            shares=s.shares,
            rollout=self.rollout,
        )

    # ------------------------------------------------------------------ one step

    def evaluate(self, step: int, agents: Rollout | None) -> float:
        """``eval/accuracy`` after step ``step``: every eval row on the server at version
        ``step`` (rank 0), the accuracy broadcast to the other ranks."""
        accuracy = 0.0
        if self.server is not None:
            engine = self.server.at_version(step)
            accuracy = evaluate_run(self.setup, engine, step, agents, world=World())
        return float(self.world.broadcast_object(accuracy, "eval"))

    def collect(self, step: int) -> tuple[Collected, dict[str, float]]:
        """Step ``step``'s batch, with stale samples dropped, and its async metrics (made on
        rank 0, broadcast to every rank)."""
        made: tuple[Collected, dict[str, float]] | None = None
        if self.pipeline is not None:
            collected, waited = self.pipeline.take(step)
            dropped = drop_stale(collected, step, self.k)
            self._dropped += dropped
            metrics = staleness_metrics(collected, step, self.k)
            metrics["async/dropped_stale"] = float(dropped)
            metrics["async/behaviour_version"] = float(behaviour_version(step, self.k))
            metrics["time/wait_for_rollouts"] = waited
            made = (collected, metrics)
        made = self.world.broadcast_object(made, "collect")
        assert made is not None
        return made

    def finish_step(self, step: int, metrics: dict[str, float]) -> str | None:
        """After step ``step``'s update: version ``step`` published to the server's files (the
        update's sync wrote it unless no update ran), the busy fractions since the last step,
        the restart count; the guard's pause reason, if any."""
        if self.sink.publish_version <= step:
            self.sink.publish_version = step
            metrics["time/weight_sync"] = metrics.get("time/weight_sync", 0.0) + (
                sync_engine(self.setup, self.sink)
            )
        if self.pipeline is None or self.server is None:  # not rank 0: rank 0 decides
            return self.world.broadcast_object(None, "guard")
        now = time.perf_counter()
        wall = max(now - self._clock, 1e-9)
        busy = self.pipeline.busy_seconds()
        update = metrics.get("time/update", 0.0) + metrics.get("time/logprobs", 0.0)
        metrics["async/rollout_busy_frac"] = min(1.0, (busy - self._busy) / wall)
        metrics["async/update_busy_frac"] = min(1.0, update / wall)
        metrics["rollout/server_restarts"] = float(self.server.restarts)
        self._clock, self._busy = now, busy
        reason = mismatch_guard(metrics, self.setup.config.grpo.async_.max_mismatch)
        return self.world.broadcast_object(reason, "guard")

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """What step ``step``'s checkpoint keeps beyond the weights: the batches made ahead.
        Waits for the producer to settle, so the data sampler's position saved with them is
        the one after them. (Rank 0 writes the manifest; the other ranks keep nothing.)"""
        if self.pipeline is None:
            return {}
        return {PENDING_KEY: pending_to_json(self.pipeline.settle(step))}

    def release(self, step: int) -> None:
        """Step ``step`` is done (and checkpointed, if it was to be): sample with its weights."""
        if self.pipeline is None or self.server is None:
            return
        self.pipeline.publish(step)
        self.server.forget_versions_below(max(0, step - self.k))
