"""The GRPO training loop: ``train(config, callbacks, output_dir=...)``, the step driver.

One step: sample prompts -> G completions each from the rollout engine -> scores (graders or a
reward function; with DAPO dynamic sampling, zero-variance groups are dropped and refilled) ->
the update phases of ``trainer.update.inputs`` -> metrics, samples, evaluation, checkpoint.

The worker and the CLI pass the job spec and everything is built from it
(:mod:`trainer.run.setup`); a caller with pieces of its own (a notebook) passes them to
:func:`train` as keyword arguments.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from grading.graders import Grader
from jobspec import JobSpec
from trainer.agents import Environment, HttpTools
from trainer.distributed.world import World, init_world, world_from_env
from trainer.errors import NonFiniteLossError, TrainerError
from trainer.models.reference import Reference
from trainer.rollout.base import RolloutEngine
from trainer.rollout.startup import StartedEngine
from trainer.run.async_run import AsyncRollouts
from trainer.run.callbacks import Callbacks
from trainer.run.checkpoints import RunCheckpoints
from trainer.run.engine_sync import push_initial_weights
from trainer.run.episodes import agent_rollout, refuse_unrunnable
from trainer.run.evaluation import evaluate_run
from trainer.run.metrics import build_samples, rollout_metrics, sampling_report
from trainer.run.rank_batch import rank_figures
from trainer.run.rank_callbacks import rank_callbacks
from trainer.run.setup import (
    DEFAULT_SAMPLE_GROUPS,
    Given,
    announce_run,
    prepare_run,
    start_run_engine,
)
from trainer.run.step_update import StepContext, train_on
from trainer.scoring.collect import Collected, collect_groups
from trainer.scoring.rewards import RewardFn, Scorer
from trainer.scoring.sampling import Rollout, SingleTurn, merge_metrics
from trainer.update.inputs import kl_only_groups

__all__ = ["NonFiniteLossError", "TrainResult", "TrainerError", "train"]


@dataclass
class TrainResult:
    final_step: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_path: Path | None = None
    stopped_early: bool = False
    # Set when the run paused itself (the async mismatch guard): why, for the job's status.
    pause_reason: str | None = None


def train(
    config: JobSpec,
    callbacks: Callbacks | None = None,
    *,
    output_dir: Path,
    resume_from: Path | None = None,
    device: str = "cpu",
    graders: Scorer | Sequence[Grader] | None = None,
    reward_fn: RewardFn | None = None,
    model: nn.Module | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    engine: RolloutEngine | None = None,
    sample_groups: int = DEFAULT_SAMPLE_GROUPS,
    world: World | None = None,
    http_tools: HttpTools | None = None,
    http_environment: Environment | None = None,
) -> TrainResult:
    """Run (or resume) a GRPO job; checkpoints go to ``output_dir/checkpoint-<step>``.

    ``resume_from`` (a checkpoint folder) restores weights, optimizer, scheduler, RNG, data
    position and the engine's weights: a resumed run samples what the whole run would have.

    Everything else comes from ``config`` unless given here:

    - ``graders``: a list of graders or a Scorer (``trainer.scoring.rewards``) instead of
      ``config.graders``; or ``reward_fn(completions, items) -> rewards``, one float each
      (metric ``reward/<function name>/mean``). Not both.
    - ``model`` and ``tokenizer`` (together): a ready Hugging Face causal LM, trained in place
      on ``device`` instead of loading ``config.model``; the KL reference is a frozen copy of it
      as given. The vllm engine loads a copy saved under ``output_dir``.
    - ``engine``: a rollout engine to sample with instead of ``config.rollout``; the run pushes
      the policy's weights into it before the first rollout and after every update, and leaves
      it open.
    - ``sample_groups``: how many rollout groups of each step go to ``callbacks.on_samples``.
    - ``world``: this process's rank among the job's ranks (default: what torchrun's
      environment says, else one rank). With several, the policy is sharded over them, each
      samples its share of every round, and only rank 0 calls ``callbacks`` and writes
      checkpoints (``trainer.distributed``; docs/scaling.md).
    - ``http_tools``/``http_environment``: what runs an agent job's http tools and
      environment (the worker's operator endpoints). Agent jobs: ``trainer.run.episodes``.

    Raises NonFiniteLossError (a TrainerError, ``reason`` "non_finite_loss") after
    consecutive non-finite updates, and ValueError for an unusable dataset or arguments.
    """
    if config.is_agentic:  # what this trainer cannot run of it fails the job, with the reason
        refuse_unrunnable(config, http_tools=http_tools, http_environment=http_environment)
    given = Given(  # checks that the overrides go together
        graders=graders,
        reward_fn=reward_fn,
        model=model,
        tokenizer=tokenizer,
        engine=engine,
        sample_groups=sample_groups,
        http_tools=http_tools,
        http_environment=http_environment,
    )
    world = world or world_from_env()
    rank_device = world.device(device)
    init_world(world, rank_device)
    cb = rank_callbacks(callbacks or Callbacks(), world)
    run = _Run(config, cb, Path(output_dir), rank_device, given, world)
    try:
        return run.execute(resume_from)
    finally:
        run.close()


class _Run:
    """One run's steps, from its setup (:func:`~trainer.run.setup.prepare_run`) to its result."""

    def __init__(
        self,
        config: JobSpec,
        callbacks: Callbacks,
        output_dir: Path,
        device: torch.device,
        given: Given,
        world: World | None = None,
    ) -> None:
        self.setup = prepare_run(config, callbacks, output_dir, device, given, world)
        self.config = config
        self.spec = config.grpo
        self.cb = callbacks
        self.checkpoints = RunCheckpoints(self.setup)
        self.started: StartedEngine | None = None
        self.engine: RolloutEngine | None = None
        self.agents = agent_rollout(config, self.setup, given)
        self.rollout: Rollout = self.agents or SingleTurn()
        # grpo.async.max_staleness >= 1: a rollout server and a producer ahead of the update.
        self.async_: AsyncRollouts | None = None

    @property
    def model(self) -> nn.Module:
        """The policy being trained."""
        return self.setup.model

    @property
    def reference(self) -> Reference | None:
        """The KL reference (None when the KL is off)."""
        return self.setup.reference

    def close(self) -> None:
        if self.async_ is not None:
            self.async_.close()  # its server is the run's engine
            self.async_ = None
            self.started = self.engine = None
        if self.agents is not None:
            self.agents.close()
            self.agents = None
        if self.started is not None:
            self.started.close()
            self.started = None
            self.engine = None

    # ------------------------------------------------------------------ main loop

    def execute(self, resume_from: Path | None) -> TrainResult:
        result = self._restore(resume_from) if resume_from is not None else TrainResult(0)
        start_step, total = result.final_step, self.spec.steps
        self._open_engine(resume_from, start_step)
        if resume_from is None and self.setup.eval_ids and self.config.eval.interval > 0:
            # Baseline before any update, so a run shows what training changed.
            self._evaluate(0)
        if start_step < total and self.cb.should_stop():
            self.cb.on_event("stop", "stop requested before the first step")
            result.stopped_early = True
            return result
        interval = self.config.checkpoint_interval
        for step in range(start_step + 1, total + 1):
            metrics, stop_requested, pause = self._step(step, final=step == total)
            self.cb.on_step(step, metrics)
            self.checkpoints.track(metrics)
            result.final_step = step
            result.last_metrics = metrics
            saved = False
            if step == total or (interval > 0 and step % interval == 0):
                result.checkpoint_path = self._save(step, metrics)
                saved = True
            stopping = step < total and (
                stop_requested or pause is not None or self.cb.should_stop()
            )
            if stopping and not saved:
                result.checkpoint_path = self._save(step, metrics)
            if self.async_ is not None:
                self.async_.release(step)
            if stopping:
                if pause is not None:
                    self.cb.on_event("paused", pause, "warning")
                    result.pause_reason = pause
                else:
                    self.cb.on_event("stop", f"stopped after step {step} as requested")
                result.stopped_early = True
                break
        return result

    def _save(self, step: int, metrics: dict[str, float]) -> Path:
        """Step ``step``'s checkpoint; an async run's keeps the batches made ahead."""
        extra = None if self.async_ is None else self.async_.checkpoint_state(step)
        return self.checkpoints.save(step, metrics, extra_state=extra)

    def _restore(self, path: Path) -> TrainResult:
        step, metrics = self.checkpoints.restore(path)
        return TrainResult(step, last_metrics=metrics, checkpoint_path=Path(path))

    def _open_engine(self, resume_from: Path | None, start_step: int) -> None:
        """Start the engine (or take the caller's), then push weights and announce the run.
        An async run starts its rollout server and its producer instead."""
        if self.spec.async_.enabled:
            self.async_ = AsyncRollouts(self.setup, self.rollout, self.config.seed)
            self.started, self.engine = self.async_.started, self.async_.engine
            restored = self.checkpoints.restored_extra if resume_from is not None else None
            pushed = self.async_.open(start_step, restored)
            announce_run(self.setup, self.started, resume_from, start_step, pushed)
            return
        self.started = start_run_engine(self.setup)
        self.engine = self.started.engine
        pushed = push_initial_weights(self.setup, self.started, resume_from is not None)
        announce_run(self.setup, self.started, resume_from, start_step, pushed)

    # ------------------------------------------------------------------ one step

    def _collect(self, step: int) -> tuple[Collected, dict[str, float]]:
        """Step ``step``'s groups: sampled now, or (async) taken from the producer."""
        if self.async_ is not None:
            return self.async_.collect(step)
        assert self.engine is not None
        setup = self.setup
        collected = collect_groups(
            self.engine,
            setup.scorer,
            setup.sampler,
            setup.train_ids,
            setup.train_rows,
            self.spec,
            seed=self.config.seed,
            step=step,
            should_stop=self.cb.should_stop,
            world=setup.world,
            shares=setup.shares,
            rollout=self.rollout,
        )
        return collected, {}

    def _step(self, step: int, *, final: bool) -> tuple[dict[str, float], bool, str | None]:
        """One step's metrics, whether a stop was asked while sampling, and the reason to
        pause (the async mismatch guard), if any."""
        setup = self.setup
        spec = self.spec
        started = time.perf_counter()
        collected, async_metrics = self._collect(step)
        metrics = rollout_metrics(collected, [*setup.scorer.names, *self.rollout.extra_names])
        metrics.update(async_metrics)
        metrics.update(merge_metrics(collected.rollout_metrics))
        kl_only = kl_only_groups(collected, spec)
        metrics.update(sampling_report(collected, kl_only, spec, step, self.cb.on_event))
        lr = float(setup.optimizer.param_groups[0]["lr"])
        by_group: dict[int, list[float]] = {}
        trained = False
        if collected.kept or kl_only:
            by_group, trained = train_on(self._step_context(), collected, kl_only, step, metrics)
        metrics["update/skipped"] = 0.0 if trained else 1.0
        if trained:
            with warnings.catch_warnings():
                # A step whose updates the non-finite guard all skipped still steps the
                # schedule (without optimizer.step()): it trained on a batch, the guard threw
                # the result away.
                warnings.filterwarnings(
                    "ignore", message=r"Detected call of `lr_scheduler\.step\(\)`"
                )
                setup.scheduler.step()
        elif not (collected.kept or kl_only):
            # No batch, no update: the schedule waits for the next step that trains.
            self.cb.on_event("no_signal", f"step {step}: no group to train on; update skipped")
        metrics["lr"] = lr
        metrics["data/skipped_prompts"] = float(setup.skipped_prompts)
        samples = build_samples(
            collected,
            by_group,
            setup.sample_prompts,
            setup.sample_answers,
            setup.sample_groups,
        )
        self.cb.on_samples(step, samples)
        pause = None if self.async_ is None else self.async_.finish_step(step, metrics)
        if setup.eval_ids and (
            final or (self.config.eval.interval > 0 and step % self.config.eval.interval == 0)
        ):
            metrics["eval/accuracy"] = self._evaluate(step)
        metrics["time/step"] = time.perf_counter() - started
        metrics.update(rank_figures(setup.world, metrics["time/step"], setup.device))
        clean = {k: float(v) for k, v in metrics.items() if math.isfinite(v)}
        return clean, collected.stop_requested, pause

    def _step_context(self) -> StepContext:
        assert self.started is not None
        return StepContext(self.setup, self.started, self.config.seed)

    def _evaluate(self, step: int) -> float:
        if self.async_ is not None:
            return self.async_.evaluate(step, self.agents)
        assert self.engine is not None
        return evaluate_run(self.setup, self.engine, step, self.agents)
