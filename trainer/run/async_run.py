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
to the server's files, :class:`trainer.rollout.remote_engine.RemoteEngine`, in the run's own
folder: :data:`VERSIONS_DIR`),
:meth:`AsyncRollouts.finish_step` (version ``t`` published even when no update ran, the async
metrics, the guard), :meth:`AsyncRollouts.checkpoint_state` when it writes a checkpoint, then
:meth:`AsyncRollouts.release` (the producer may sample with version ``t``).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from jobspec.grpo_options import AsyncSpec
from trainer.distributed.world import World
from trainer.errors import TrainerError
from trainer.rollout.base import Completion, RolloutEngine
from trainer.rollout.startup import StartedEngine
from trainer.run.async_rollouts import (
    PENDING_KEY,
    SAMPLER_BEFORE_KEY,
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
    "ENGINE_MISMATCH_METRIC",
    "PENDING_KEY",
    "VERSIONS_DIR",
    "AsyncRollouts",
    "GatherOnly",
    "async_refusal",
    "mismatch_guard",
    "server_threads",
    "with_engine_mismatch",
]

MISMATCH_METRIC = "mismatch/token_mult_prob_error"
CAPPED_METRIC = "mismatch/capped_frac"
# The engine's own numeric mismatch: MISMATCH_METRIC on a step whose samples came from the
# trainer's current weights, the only steps where no policy movement is mixed in.
ENGINE_MISMATCH_METRIC = "mismatch/engine_token_mult_prob_error"
# The rollout server's folder (its config, log and the published weight versions, each a whole
# copy of the weights) under the run's output folder: on the job's disk and quota, not in the
# system's temporary folder (often a RAM disk on GPU nodes). Emptied as versions retire, removed
# when the run ends, and a dead run's leftovers are removed when the next attempt starts.
VERSIONS_DIR = ".rollout-server"


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


def with_engine_mismatch(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` with :data:`ENGINE_MISMATCH_METRIC` added when the step's samples came from
    the trainer's current weights (``async/staleness_max`` 0): then ``token_mult_prob_error``
    is the engine against the trainer on the same weights. On a stale step it also holds the
    policy's movement over the lag, which the sampler correction weighs, so it is not added."""
    if metrics.get("async/staleness_max") == 0.0 and MISMATCH_METRIC in metrics:
        metrics[ENGINE_MISMATCH_METRIC] = metrics[MISMATCH_METRIC]
    return metrics


def mismatch_guard(metrics: dict[str, float], spec: AsyncSpec) -> str | None:
    """The reason to pause after a step, for what the sampler correction cannot fix: the
    engine's own mismatch past ``max_mismatch`` (:func:`with_engine_mismatch`), or a share of
    tokens whose weight the cap cut past ``max_capped_frac``. None: go on."""
    engine = metrics.get(ENGINE_MISMATCH_METRIC)
    if engine is not None and engine > spec.max_mismatch:
        return (
            f"paused by the mismatch guard: {ENGINE_MISMATCH_METRIC} {engine:.4f} > "
            f"grpo.async.max_mismatch {spec.max_mismatch} (the engine's samples disagree with "
            "the trainer on the same weights: check rollout.dtype and the engine, or raise "
            "the bound if this is expected, then resume)"
        )
    capped = metrics.get(CAPPED_METRIC)
    if capped is not None and capped > spec.max_capped_frac:
        return (
            f"paused by the mismatch guard: {CAPPED_METRIC} {capped:.4f} > "
            f"grpo.async.max_capped_frac {spec.max_capped_frac} (the samples are too far off "
            "the trainer's policy for the sampler correction's cap; lower grpo.learning_rate "
            "or grpo.async.max_staleness, then resume: POST /v1/jobs/{id}/resume with "
            '{"set": {...}}, or grpo jobs resume JOB --set)'
        )
    return None


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
        self.folder = setup.output_dir / VERSIONS_DIR
        # The others wait for the start on rank 0's heartbeat: a large model's server takes
        # minutes, and the next collective (the first weights' gathers) would time out.
        with self.world.main_alone("rollout_server"):
            if self.world.is_main:
                threads = setup.config.grpo.async_.server_threads or server_threads(
                    setup.device.type
                )
                shutil.rmtree(self.folder, ignore_errors=True)  # a dead attempt's versions
                self.folder.mkdir(parents=True)
                self.server = self.sink = start_remote_engine(
                    setup, threads=threads, root=self.folder
                )
            else:
                self.sink = GatherOnly()
        self.started = StartedEngine(self.sink, None, owned=True)
        self.pipeline: RolloutPipeline | None = None
        # The first version this run publishes (its start step), and the steps whose batches
        # the checkpoint kept (sampled on the schedule of the run that made them).
        self._oldest = 0
        self._kept: set[int] = set()
        # The data sampler's state before each step the producer made (what a checkpoint keeps
        # for a resume with another K, :func:`trainer.run.async_rollouts.plan_resume`).
        self._sampler_before: dict[int, dict[str, Any]] = {}
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
        (with the batches the checkpoint kept, when resuming: ``restored_extra`` as
        :meth:`trainer.run.checkpoints.RunCheckpoints.restore` planned it); seconds the
        weights took."""
        self.sink.publish_version = start_step
        self._oldest = start_step
        seconds = sync_engine(self.setup, self.sink)  # every rank: the gathers are collective
        if self.server is None:
            self._clock = time.perf_counter()
            return seconds
        restored = restored_extra or {}
        pending = pending_from_json(restored.get(PENDING_KEY) or {})
        self._kept = set(pending)
        before = restored.get(SAMPLER_BEFORE_KEY) or {}
        self._sampler_before = {int(step): state for step, state in before.items()}
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
        if self.server is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _produce(self, step: int, version: int) -> Collected:
        s = self.setup
        assert self.server is not None
        self._sampler_before[step] = s.sampler.state().to_dict()
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
        with self.world.main_alone("eval"):
            if self.server is not None:
                engine = self.server.at_version(step)
                accuracy = evaluate_run(self.setup, engine, step, agents, world=World())
        return float(self.world.broadcast_object(accuracy, "eval"))

    def collect(self, step: int) -> tuple[Collected, dict[str, float]]:
        """Step ``step``'s batch, with stale samples dropped, and its async metrics (made on
        rank 0, broadcast to every rank)."""
        made: tuple[Collected, dict[str, float]] | None = None
        with self.world.main_alone("collect"):  # a step's rollouts may outlast the timeout
            if self.pipeline is not None:
                made = self._take(step)
        made = self.world.broadcast_object(made, "collect")
        assert made is not None
        return made

    def _take(self, step: int) -> tuple[Collected, dict[str, float]]:
        """Rank 0: step ``step``'s batch from the producer, stale samples dropped, with its
        async metrics."""
        assert self.pipeline is not None
        collected, waited = self.pipeline.take(step)
        self._sampler_before.pop(step, None)
        dropped = drop_stale(collected, step, self.k)
        self._dropped += dropped
        metrics = staleness_metrics(collected, step, self.k)
        metrics["async/dropped_stale"] = float(dropped)
        oldest = 0 if step in self._kept else self._oldest
        metrics["async/behaviour_version"] = float(behaviour_version(step, self.k, oldest))
        metrics["time/wait_for_rollouts"] = waited
        return collected, metrics

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
        reason = mismatch_guard(with_engine_mismatch(metrics), self.setup.config.grpo.async_)
        return self.world.broadcast_object(reason, "guard")

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """What step ``step``'s checkpoint keeps beyond the weights: the batches made ahead,
        and the data sampler's state before each. Waits for the producer to settle, so the
        data sampler's position saved with them is the one after them. (Rank 0 writes the
        manifest; the other ranks keep nothing.)"""
        with self.world.main_alone("settle"):  # the producer may be mid-batch
            if self.pipeline is None:
                return {}
            pending = self.pipeline.settle(step)
        # (A batch kept from a checkpoint written before these states were has none.)
        known = self._sampler_before
        before = {str(s): known[s] for s in sorted(pending) if s in known}
        return {PENDING_KEY: pending_to_json(pending), SAMPLER_BEFORE_KEY: before}

    def release(self, step: int) -> None:
        """Step ``step`` is done (and checkpointed, if it was to be): sample with its weights."""
        if self.pipeline is None or self.server is None:
            return
        self.pipeline.publish(step)
        self.server.forget_versions_below(max(0, step - self.k))
