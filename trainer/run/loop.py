"""The GRPO training loop: ``train(config, callbacks, output_dir=...)``.

One step: sample prompts -> G completions each from the rollout engine -> scores (graders or a
reward function; with DAPO dynamic sampling, zero-variance groups are dropped and refilled) ->
the update phases of ``trainer.update.phases`` -> metrics, samples, evaluation, checkpoint.

The worker and the CLI pass the job spec and everything is built from it; a caller with pieces
of its own (a notebook) passes them to :func:`train` as keyword arguments.
"""

from __future__ import annotations

import math
import random
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from trainer.checkpoint.store import (
    RETENTION_METRIC,
    load_checkpoint,
    save_checkpoint,
    sweep_temp_dirs,
)
from trainer.config import JobSpec
from trainer.data.dataset import (
    PromptSampler,
    SamplerState,
    dataset_rows,
    prompts_for_run,
    split_holdout,
)
from trainer.errors import NonFiniteLossError, TrainerError
from trainer.graders import Grader
from trainer.models.loading import (
    disable_dropout,
    enable_gradient_checkpointing,
    load_policy,
    resolve_model,
)
from trainer.models.lora import apply_lora
from trainer.models.precision import enable_tf32
from trainer.models.reference import Reference, reference_for
from trainer.rollout.base import RolloutEngine
from trainer.rollout.startup import StartedEngine, start_engine
from trainer.run.callbacks import Callbacks, RunInfo
from trainer.run.metrics import build_samples, evaluate, rollout_metrics
from trainer.scoring.collect import Collected, collect_groups
from trainer.scoring.rewards import RewardFn, Scorer, resolve_scorer
from trainer.update.optim import build_optimizer
from trainer.update.passes import NonFiniteGuard, run_updates
from trainer.update.phases import (
    advantages_by_group,
    compute_advantages,
    has_signal,
    needs_old_logprobs,
    pack_groups,
    reward_kl_penalty,
    score_logprobs,
    shaped_rewards,
    update_step_metrics,
)
from trainer.update.step import derive_seed, make_scheduler

__all__ = ["NonFiniteLossError", "TrainResult", "TrainerError", "train"]

DEFAULT_SAMPLE_GROUPS = 2  # rollout groups handed to on_samples each step
_EVAL_SEED_SALT = 99_991


@dataclass
class TrainResult:
    final_step: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_path: Path | None = None
    stopped_early: bool = False


@dataclass(frozen=True)
class _Given:
    """What the caller of :func:`train` supplied instead of the job spec (None: build it)."""

    graders: Scorer | Sequence[Grader] | None = None
    reward_fn: RewardFn | None = None
    model: nn.Module | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    engine: RolloutEngine | None = None
    sample_groups: int = DEFAULT_SAMPLE_GROUPS


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
) -> TrainResult:
    """Run (or resume) a GRPO job; checkpoints go to ``output_dir/checkpoint-<step>``.

    ``resume_from`` (a checkpoint folder) restores weights, optimizer, scheduler, RNG and data
    position, and pushes the restored weights into the rollout engine before the first rollout,
    so a resumed run samples exactly what the uninterrupted run would have.

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

    Raises NonFiniteLossError (a TrainerError, ``reason`` "non_finite_loss") after
    consecutive non-finite updates, and ValueError for an unusable dataset or arguments.
    """
    if (model is None) != (tokenizer is None):
        raise ValueError("pass model and tokenizer together (or neither)")
    if graders is not None and reward_fn is not None:
        raise ValueError("pass graders or reward_fn, not both")
    if sample_groups < 0:
        raise ValueError(f"sample_groups must be >= 0, got {sample_groups}")
    given = _Given(graders, reward_fn, model, tokenizer, engine, sample_groups)
    run = _Run(config, callbacks or Callbacks(), Path(output_dir), torch.device(device), given)
    try:
        return run.execute(resume_from)
    finally:
        run.close()


class _Run:
    def __init__(
        self,
        config: JobSpec,
        callbacks: Callbacks,
        output_dir: Path,
        device: torch.device,
        given: _Given,
    ) -> None:
        self.config = config
        self.spec = config.grpo
        self.cb = callbacks
        self.output_dir = output_dir
        self.device = device
        self.given_engine = given.engine
        self.sample_groups = given.sample_groups
        self.started: StartedEngine | None = None
        self.engine: RolloutEngine | None = None
        # checkpoint.keep_best_by's latest value so far (what the retention rule ranks by).
        self.best_by_value: float | None = None
        output_dir.mkdir(parents=True, exist_ok=True)
        for swept in sweep_temp_dirs(output_dir):
            self.cb.on_event("checkpoint", f"removed an interrupted checkpoint write: {swept.name}")

        # Rows first: a bad dataset fails before any model is loaded.
        self._load_rows()
        self.scorer = resolve_scorer(given.graders, given.reward_fn, config.graders)
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        self._load_policy(given.model, given.tokenizer)
        self._encode_prompts()
        self.optimizer = build_optimizer(self.model, self.spec)
        self.scheduler = make_scheduler(self.optimizer, self.spec)
        self.guard = NonFiniteGuard(self.cb.on_event)
        self.reference = self._reference()

    def _load_rows(self) -> None:
        """Training and held-out rows (the prompts are tokenized, and too long ones skipped,
        once the tokenizer is loaded: :meth:`_encode_prompts`)."""
        ds = self.config.dataset
        self.train_rows, self.eval_rows = split_holdout(dataset_rows(ds), ds.holdout)

    def _load_policy(
        self, model: nn.Module | None, tokenizer: PreTrainedTokenizerBase | None
    ) -> None:
        """The policy on the run's device (the caller's object, or ``config.model`` loaded in
        float32: the master weights, whatever ``grpo.dtype``) with gradient checkpointing as
        the spec says, wrapped with LoRA adapters when ``config.lora`` asks, and its
        tokenizer."""
        self.model_path: Path | None = None
        if model is None or tokenizer is None:
            self.model_path = resolve_model(self.config.model, revision=self.config.model_revision)
            model, tokenizer = load_policy(self.model_path, dtype=torch.float32)
        self.model: nn.Module = model
        self.tokenizer = tokenizer
        model.to(self.device)  # in place: a caller's model object stays the trained one
        if disable_dropout(model):
            self.cb.on_event("config", "dropout is off in the update, as in the scoring passes")
        if self.spec.gradient_checkpointing and not enable_gradient_checkpointing(model):
            self.cb.on_event(
                "config",
                f"{type(model).__name__} cannot recompute activations; "
                "gradient_checkpointing is off for this run",
                level="warning",
            )
        if self.config.lora is not None:
            # Recorded as the adapter's base: the job's own word for it, never a server path.
            self.model = apply_lora(model, self.config.lora, base_name=self.config.model)
        if enable_tf32(self.device):
            self.cb.on_event("config", "TF32 matmuls on for float32 work on this device")

    def _encode_prompts(self) -> None:
        """Training and evaluation prompts as token ids, without the rows whose prompt is over
        ``max_prompt_tokens`` (an event lists them; PromptsTooLong when no training row is
        left); the sampler over the training rows, what ``on_samples`` shows of each row (its
        prompt as written, not the chat-formatted text), and the pad id of the tokenizer."""
        tok, ds = self.tokenizer, self.config.dataset
        pad = tok.pad_token_id
        self.pad_id = int(pad if pad is not None else tok.eos_token_id or 0)
        prompts = prompts_for_run(
            tok,
            self.train_rows,
            self.eval_rows,
            ds,
            self.spec.max_prompt_tokens,
            eval_max_rows=self.config.eval.max_rows,
        )
        self.train_rows, self.train_ids = prompts.train_rows, prompts.train_ids
        self.eval_rows, self.eval_ids = prompts.eval_rows, prompts.eval_ids
        self.skipped_prompts = len(prompts.skipped)
        if prompts.skipped:
            message, data = prompts.skipped_event()
            self.cb.on_event("dataset", message, level="warning", data=data)
        self.sample_prompts = [row.display_prompt for row in self.train_rows]
        self.sample_answers = [row.answer for row in self.train_rows]
        self.sampler = PromptSampler(
            len(self.train_rows), seed=self.config.seed, shuffle=ds.shuffle
        )

    def _reference(self) -> Reference | None:
        """The KL reference: the policy as the run starts (the base model, also when resuming,
        since checkpoints are loaded after this; ``trainer.models.reference``); None when the KL is
        off."""
        if not self.spec.kl.active:
            return None
        return reference_for(self.model, self.spec.dtype)

    def close(self) -> None:
        if self.started is not None:
            self.started.close()
            self.started = None
            self.engine = None

    # ------------------------------------------------------------------ main loop

    def execute(self, resume_from: Path | None) -> TrainResult:
        result = self._restore(resume_from) if resume_from is not None else TrainResult(0)
        start_step, total = result.final_step, self.spec.steps
        self._open_engine(resume_from, start_step)
        if resume_from is None and self.eval_ids and self.config.eval.interval > 0:
            # Baseline before any update, so a run shows what training changed.
            self._evaluate(0)
        if start_step < total and self.cb.should_stop():
            self.cb.on_event("stop", "stop requested before the first step")
            result.stopped_early = True
            return result
        interval = self.config.checkpoint_interval
        for step in range(start_step + 1, total + 1):
            metrics, stop_requested = self._step(step, final=step == total)
            self.cb.on_step(step, metrics)
            self._track_best_by(metrics)
            result.final_step = step
            result.last_metrics = metrics
            saved = False
            if step == total or (interval > 0 and step % interval == 0):
                result.checkpoint_path = self._save(step, metrics)
                saved = True
            if step < total and (stop_requested or self.cb.should_stop()):
                if not saved:
                    result.checkpoint_path = self._save(step, metrics)
                self.cb.on_event("stop", f"stopped after step {step} as requested")
                result.stopped_early = True
                break
        return result

    def _restore(self, path: Path) -> TrainResult:
        """Load a checkpoint into the policy, optimizer, scheduler, RNGs and data sampler."""
        state = load_checkpoint(Path(path), self.model, self.optimizer, self.scheduler)
        self.sampler.restore(SamplerState.from_dict(state.sampler))
        self.guard.streak = int(state.extra.get("nonfinite_streak", 0))
        best_by = state.extra.get(RETENTION_METRIC)
        if isinstance(best_by, dict) and best_by.get("name") == self.config.checkpoint.keep_best_by:
            value = best_by.get("value")
            self.best_by_value = float(value) if isinstance(value, int | float) else None
        metrics = dict(state.extra.get("metrics", {}))
        return TrainResult(state.step, last_metrics=metrics, checkpoint_path=Path(path))

    def _open_engine(self, resume_from: Path | None, start_step: int) -> None:
        """Start the engine of ``config.rollout`` (or take the caller's), give it the policy's
        weights where it may not hold them yet, and announce the run."""
        if self.given_engine is not None:
            self.started = StartedEngine(self.given_engine, None, owned=False)
        else:
            self.started = start_engine(
                self.config,
                self.model_path,
                self.tokenizer,
                self.model,
                self.train_ids,
                self.eval_ids,
                self.device,
                staging_root=self.output_dir,
            )
        self.engine = self.started.engine
        sync_seconds = 0.0
        if resume_from is not None or not self.started.owned:
            # A built engine holds the weights it was built from: push restored ones before any
            # rollout. A caller's engine may hold anything: always push.
            sync_seconds = self.engine.sync_weights(self.model)
        resumed = Path(resume_from) if resume_from is not None else None
        self.cb.on_start(
            RunInfo(
                total_steps=self.spec.steps,
                start_step=start_step,
                model_path=self.model_path,
                output_dir=self.output_dir,
                device=str(self.device),
                engine=self.started.kind(self.config),
                resumed_from=resumed,
            )
        )
        line = self.started.describe(self.config)
        if line is not None:
            self.cb.on_event("engine", line, data={"kv_cache_bytes": self.started.kv_cache_bytes})
        if resumed is not None:
            self.cb.on_event(
                "resume",
                # The folder's name only: a service shows events to users, paths are its own.
                f"resumed from {resumed.name} at step {start_step}; weights pushed to the "
                f"engine in {sync_seconds:.2f}s",
                data={"step": start_step, "checkpoint": resumed.name},
            )

    def _track_best_by(self, metrics: dict[str, float]) -> None:
        name = self.config.checkpoint.keep_best_by
        if name is not None and name in metrics and math.isfinite(metrics[name]):
            self.best_by_value = float(metrics[name])

    def _save(self, step: int, metrics: dict[str, float]) -> Path:
        """Write the checkpoint of ``step``, then apply the spec's checkpoint retention, unless
        the callbacks apply it themselves (the service's worker: its records must agree with
        the disk, so it alone deletes)."""
        retention = self.config.checkpoint
        extra: dict[str, object] = {"nonfinite_streak": self.guard.streak, "metrics": metrics}
        if retention.keep_best_by is not None:
            extra[RETENTION_METRIC] = {"name": retention.keep_best_by, "value": self.best_by_value}
        path = save_checkpoint(
            self.output_dir,
            step,
            model=self.model,
            tokenizer=self.tokenizer,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            sampler=self.sampler.state().to_dict(),
            extra=extra,
            retention=None if self.cb.applies_retention else retention,
        )
        self.cb.on_checkpoint(step, path)
        return path

    # ------------------------------------------------------------------ one step

    def _step(self, step: int, *, final: bool) -> tuple[dict[str, float], bool]:
        spec = self.spec
        assert self.engine is not None
        started = time.perf_counter()
        col = collect_groups(
            self.engine,
            self.scorer,
            self.sampler,
            self.train_ids,
            self.train_rows,
            spec,
            seed=self.config.seed,
            step=step,
            should_stop=self.cb.should_stop,
        )
        metrics = rollout_metrics(col, self.scorer.names)
        for name, message in col.grader_messages.items():
            self.cb.on_event(
                "grader",
                f"step {step}: grader {name} failed on {col.grader_errors.get(name, 0)} "
                f"samples (scored 0); first error: {message}",
                level="warning",
                data={"grader": name, "errors": col.grader_errors.get(name, 0), "first": message},
            )
        if spec.dynamic_sampling.enabled:
            # Only dynamic sampling drops groups; frac_zero_std_groups covers the rest.
            dropped = col.num_zero_std
            surplus = len(col.groups) - len(col.kept) - dropped
            metrics["dynamic_sampling/rounds"] = float(col.rounds)
            metrics["dynamic_sampling/kept_groups"] = float(len(col.kept))
            metrics["dynamic_sampling/dropped_groups"] = float(dropped)
            if dropped:
                self.cb.on_event(
                    "dynamic_sampling",
                    f"step {step}: dropped {dropped} of {len(col.groups)} groups with equal "
                    f"rewards ({col.rounds} sampling rounds, {len(col.kept)} groups trained on, "
                    f"{surplus} more left out)",
                    data={"rounds": col.rounds, "dropped": dropped, "surplus": surplus},
                )
        lr = float(self.optimizer.param_groups[0]["lr"])
        advantages: dict[int, list[float]] = {}
        trained = False
        if col.kept:
            advantages, trained = self._train_on(col, step, metrics)
        metrics["update/skipped"] = 0.0 if trained else 1.0
        if trained:
            with warnings.catch_warnings():
                # A step whose updates the non-finite guard all skipped still steps the
                # schedule (without optimizer.step()): it trained on a batch, the guard threw
                # the result away.
                warnings.filterwarnings(
                    "ignore", message=r"Detected call of `lr_scheduler\.step\(\)`"
                )
                self.scheduler.step()
        elif not col.kept:
            # No batch, no update: the schedule waits for the next step that trains.
            self.cb.on_event("no_signal", f"step {step}: no group to train on; update skipped")
        metrics["lr"] = lr
        metrics["data/skipped_prompts"] = float(self.skipped_prompts)
        samples = build_samples(
            col, advantages, self.sample_prompts, self.sample_answers, self.sample_groups
        )
        self.cb.on_samples(step, samples)
        if self.eval_ids and (
            final or (self.config.eval.interval > 0 and step % self.config.eval.interval == 0)
        ):
            metrics["eval/accuracy"] = self._evaluate(step)
        metrics["time/step"] = time.perf_counter() - started
        clean = {k: float(v) for k, v in metrics.items() if math.isfinite(v)}
        return clean, col.stop_requested

    def _train_on(
        self, col: Collected, step: int, metrics: dict[str, float]
    ) -> tuple[dict[int, list[float]], bool]:
        """The update phases (``trainer.update.phases``) on the kept groups, in order; fills
        ``metrics`` and returns the advantages by group position in ``col.kept`` and whether
        an update ran (False when the batch has no signal: every advantage 0 and no loss-side
        term, see :func:`trainer.update.phases.has_signal`)."""
        spec = self.spec
        assert self.engine is not None
        clock = time.perf_counter()
        batch = pack_groups(col.kept, spec, self.device)
        shaped = shaped_rewards(col.kept, batch, spec)
        metrics["time/reward"] += time.perf_counter() - clock

        # The update needs the device memory the engine's KV cache holds (GPU sleep mode).
        level = self._engine_sleeps()
        clock = time.perf_counter()
        with_old = needs_old_logprobs(spec, batch.size)
        scored = score_logprobs(
            self.model, self.reference, batch, spec, pad_id=self.pad_id, with_old=with_old
        )
        metrics["time/logprobs"] = time.perf_counter() - clock

        penalty = reward_kl_penalty(scored, batch, spec)
        adv = compute_advantages(shaped, penalty, spec)
        if penalty is not None:
            metrics["kl/reward_penalty"] = float(penalty.mean())

        if not has_signal(adv, spec, scored):
            # Nothing to learn from: no optimizer step (AdamW's momentum would still move every
            # weight), no schedule step, no sync, unless a level-2 sleep dropped the engine's
            # weights, which it needs back either way.
            self._wake_engine(level == 2)
            metrics["time/update"] = 0.0
            return advantages_by_group(adv, len(col.kept), spec.group_size), False

        clock = time.perf_counter()
        stats, pre = run_updates(
            self.model,
            self.optimizer,
            batch,
            adv,
            spec=spec,
            step=step,
            seed=self.config.seed,
            old_logprobs=scored.old,
            ref_logprobs=scored.ref,
            pad_id=self.pad_id,
            guard=self.guard,
            collect_pre_update=not with_old,
        )
        metrics["time/update"] = time.perf_counter() - clock
        # Prompt and completion tokens of the batch, once per update pass over it: what the
        # step trained on (the OpenAI view's trained_tokens sums it over steps).
        metrics["tokens/trained"] = float(
            spec.num_iterations
            * sum(len(p) + len(c) for p, c in zip(batch.prompts, batch.completions, strict=True))
        )

        # Only an applied update changed the weights the engine generates with; an engine
        # that dropped its weights to sleep (level 2) needs them back either way.
        applied = stats.updates > stats.skipped
        metrics["time/weight_sync"] = self._wake_engine(applied or level == 2)
        metrics.update(update_step_metrics(stats, adv, batch, scored, pre, spec))
        return advantages_by_group(adv, len(col.kept), spec.group_size), True

    def _wake_engine(self, must_sync: bool) -> float:
        """Wake a sleeping engine and, when ``must_sync``, sync the policy's weights into it;
        the sync's seconds (0 without one)."""
        assert self.engine is not None
        wake = getattr(self.engine, "wake", None)
        if callable(wake):
            wake()
        return self.engine.sync_weights(self.model) if must_sync else 0.0

    def _engine_sleeps(self) -> int | None:
        """Put a sleep-capable engine (vLLM on a GPU) to sleep for the update; its level."""
        plan = self.started.colocation if self.started is not None else None
        sleep = getattr(self.engine, "sleep", None)
        if plan is None or plan.sleep_level is None or not callable(sleep):
            return None
        sleep(plan.sleep_level)
        return plan.sleep_level

    def _evaluate(self, step: int) -> float:
        assert self.engine is not None
        rows = self.eval_rows[: len(self.eval_ids)]
        seed = derive_seed(self.config.seed, step, _EVAL_SEED_SALT)
        items = [row.grading_item for row in rows]
        accuracy = evaluate(self.engine, self.scorer, self.eval_ids, items, self.spec, seed=seed)
        self.cb.on_event(
            "eval",
            f"step {step}: eval accuracy {accuracy:.3f} on {len(rows)} rows",
            data={"step": step, "accuracy": accuracy, "rows": len(rows)},
        )
        return accuracy
