"""The GRPO training loop: ``train(config, callbacks, output_dir=...)``.

One step: sample prompts -> G completions each from the rollout engine -> graders -> optional
overlong penalty -> optional KL penalty in the reward -> group advantages (with DAPO dynamic
sampling, zero-variance groups are dropped and refilled) -> ``num_iterations`` passes of
minibatched clipped policy-gradient updates -> push weights into the engine -> metrics.

Evaluation (``eval/accuracy``): greedy decoding of the held-out rows; a row counts as correct
when its total reward reaches the sum of the positive grader weights, i.e. every positively
weighted grader gave full marks (with no positive weight at all: the mean total reward).
"""

from __future__ import annotations

import math
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from trainer import kl as kl_math
from trainer.advantages import group_advantages
from trainer.callbacks import Callbacks, RunInfo
from trainer.checkpoint import load_checkpoint, save_checkpoint, sweep_temp_dirs
from trainer.collect import Collected, collect_groups
from trainer.config import JobSpec
from trainer.data import (
    PromptSampler,
    SamplerState,
    dataset_rows,
    encode_prompts,
    split_holdout,
)
from trainer.errors import NonFiniteLossError, TrainerError
from trainer.graders import build_graders
from trainer.metrics import (
    build_samples,
    eval_accuracy,
    rollout_metrics,
    token_metrics,
    update_metrics,
)
from trainer.models import enable_gradient_checkpointing, load_policy, resolve_model
from trainer.rollout.base import RolloutEngine
from trainer.rollout.startup import start_engine
from trainer.shaping import overlong_penalty, truncation_loss_mask
from trainer.step import (
    Batch,
    NonFiniteGuard,
    derive_seed,
    forward_logprobs,
    make_scheduler,
    pack_batch,
    run_updates,
)

__all__ = ["NonFiniteLossError", "TrainResult", "TrainerError", "train"]

SAMPLE_GROUPS_PER_STEP = 2  # rollout groups handed to on_samples each step
KEEP_CHECKPOINTS = 3
_EVAL_SEED_SALT = 99_991


@dataclass
class TrainResult:
    final_step: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_path: Path | None = None
    stopped_early: bool = False


def train(
    config: JobSpec,
    callbacks: Callbacks | None = None,
    *,
    output_dir: Path,
    resume_from: Path | None = None,
    device: str = "cpu",
) -> TrainResult:
    """Run (or resume) a GRPO job; checkpoints go to ``output_dir/checkpoint-<step>``.

    ``resume_from`` (a checkpoint folder) restores weights, optimizer, scheduler, RNG and data
    position, and pushes the restored weights into the rollout engine before the first rollout,
    so a resumed run samples exactly what the uninterrupted run would have.
    Raises NonFiniteLossError (a TrainerError, ``reason`` "non_finite_loss") after
    consecutive non-finite updates, and ValueError for an unusable dataset.
    """
    run = _Run(config, callbacks or Callbacks(), Path(output_dir), torch.device(device))
    try:
        return run.execute(resume_from)
    finally:
        run.close()


class _Run:
    def __init__(
        self, config: JobSpec, callbacks: Callbacks, output_dir: Path, device: torch.device
    ) -> None:
        self.config = config
        self.spec = config.grpo
        self.cb = callbacks
        self.output_dir = output_dir
        self.device = device
        self.engine: RolloutEngine | None = None
        output_dir.mkdir(parents=True, exist_ok=True)
        for swept in sweep_temp_dirs(output_dir):
            self.cb.on_event("checkpoint", f"removed an interrupted checkpoint write: {swept.name}")

        # Rows first: a bad dataset fails before any model is loaded.
        rows = dataset_rows(config.dataset)
        self.train_rows, self.eval_rows = split_holdout(rows, config.dataset.holdout)
        self.graders = build_graders(config.graders)

        random.seed(config.seed)
        torch.manual_seed(config.seed)
        self.model_path = resolve_model(config.model)
        self.model, self.tokenizer = load_policy(self.model_path, dtype=torch.float32)
        _to_device(self.model, device)
        if self.spec.gradient_checkpointing and not enable_gradient_checkpointing(self.model):
            self.cb.on_event(
                "config",
                f"{type(self.model).__name__} cannot recompute activations; "
                "gradient_checkpointing is off for this run",
                level="warning",
            )
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id or 0)
        ds = config.dataset
        self.train_ids = encode_prompts(
            self.tokenizer, self.train_rows, ds, self.spec.max_prompt_tokens
        )
        self.eval_ids = encode_prompts(
            self.tokenizer, self.eval_rows[: config.eval.max_rows], ds, self.spec.max_prompt_tokens
        )
        # What on_samples shows: the row's prompt as written (not the chat-formatted text).
        self.sample_prompts = [row.prompt for row in self.train_rows]
        self.sample_answers = [row.answer for row in self.train_rows]
        self.sampler = PromptSampler(len(self.train_rows), seed=config.seed, shuffle=ds.shuffle)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.spec.learning_rate,
            weight_decay=self.spec.weight_decay,
        )
        self.scheduler = make_scheduler(self.optimizer, self.spec)
        self.guard = NonFiniteGuard(self.cb.on_event)
        self.ref_model: nn.Module | None = None
        if self.spec.kl.active:
            # The reference is always the base model, also when resuming from a checkpoint.
            ref_model, _ = load_policy(self.model_path, dtype=torch.float32)
            _to_device(ref_model, device)
            self.ref_model = ref_model.eval().requires_grad_(False)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # ------------------------------------------------------------------ main loop

    def execute(self, resume_from: Path | None) -> TrainResult:
        start_step = 0
        result = TrainResult(final_step=0)
        if resume_from is not None:
            state = load_checkpoint(Path(resume_from), self.model, self.optimizer, self.scheduler)
            self.sampler.restore(SamplerState.from_dict(state.sampler))
            self.guard.streak = int(state.extra.get("nonfinite_streak", 0))
            start_step = state.step
            result = TrainResult(
                final_step=start_step,
                last_metrics=dict(state.extra.get("metrics", {})),
                checkpoint_path=Path(resume_from),
            )
        sync_seconds = 0.0
        started = start_engine(
            self.config,
            self.model_path,
            self.tokenizer,
            self.model,
            self.train_ids,
            self.eval_ids,
            self.device,
        )
        self.engine = engine = started.engine
        if resume_from is not None:
            # The engine loaded the base weights: push the restored ones before any rollout.
            sync_seconds = engine.sync_weights(self.model)
        total = self.spec.steps
        self.cb.on_start(
            RunInfo(
                total_steps=total,
                start_step=start_step,
                model_path=self.model_path,
                output_dir=self.output_dir,
                device=str(self.device),
                engine=self.config.rollout.engine,
                resumed_from=Path(resume_from) if resume_from is not None else None,
            )
        )
        engine_line = started.describe(self.config)
        if engine_line is not None:
            self.cb.on_event("engine", engine_line, data={"kv_cache_bytes": started.kv_cache_bytes})
        if resume_from is not None:
            self.cb.on_event(
                "resume",
                f"resumed from {resume_from} at step {start_step}; weights pushed to the "
                f"engine in {sync_seconds:.2f}s",
                data={"step": start_step, "path": str(resume_from)},
            )
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

    def _save(self, step: int, metrics: dict[str, float]) -> Path:
        path = save_checkpoint(
            self.output_dir,
            step,
            model=self.model,
            tokenizer=self.tokenizer,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            sampler=self.sampler.state().to_dict(),
            extra={"nonfinite_streak": self.guard.streak, "metrics": metrics},
            keep=KEEP_CHECKPOINTS,
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
            self.graders,
            self.sampler,
            self.train_ids,
            self.train_rows,
            spec,
            seed=self.config.seed,
            step=step,
            should_stop=self.cb.should_stop,
        )
        dropped = len(col.groups) - len(col.kept)
        if dropped:  # only dynamic sampling drops groups; frac_zero_std_groups covers the rest
            self.cb.on_event(
                "dynamic_sampling",
                f"step {step}: dropped {dropped} of {len(col.groups)} groups with equal rewards "
                f"({col.rounds} sampling rounds, {len(col.kept)} groups trained on)",
                data={"rounds": col.rounds, "dropped": dropped},
            )
        metrics = rollout_metrics(col, self.graders.names)
        lr = float(self.optimizer.param_groups[0]["lr"])
        advantages: dict[int, list[float]] = {}
        if col.kept:
            advantages = self._train_on(col, step, metrics)
        else:
            self.cb.on_event("no_signal", f"step {step}: no group to train on; update skipped")
        with warnings.catch_warnings():
            # A step whose updates were all skipped steps the schedule without optimizer.step().
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            self.scheduler.step()
        metrics["lr"] = lr
        samples = build_samples(
            col, advantages, self.sample_prompts, self.sample_answers, SAMPLE_GROUPS_PER_STEP
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
    ) -> dict[int, list[float]]:
        """Shaping, advantages, updates and weight sync for the kept groups; fills ``metrics``
        and returns the advantages by group position in ``col.kept``."""
        spec = self.spec
        kl_spec = spec.kl
        comps = [c for g in col.kept for c in g.completions]
        g_size = spec.group_size
        started = time.perf_counter()
        task = torch.tensor([r for g in col.kept for r in g.rewards], device=self.device)
        truncated = torch.tensor([c.finish_reason == "length" for c in comps], device=self.device)
        batch = pack_batch(
            [g.prompt_ids for g in col.kept for _ in range(g_size)],
            [c.token_ids for c in comps],
            [c.logprobs for c in comps],
            [c.finish_reason == "length" for c in comps],
            truncation_loss_mask(truncated, spec.mask_truncated),
            self.device,
        )
        shaped = task.clone().float()
        if spec.overlong.enabled:
            shaped += overlong_penalty(
                batch.lengths,
                spec.max_new_tokens,
                spec.overlong.cache_tokens,
                spec.overlong.penalty,
            )
        reward_time = time.perf_counter() - started

        # Old logprobs need their own pass unless the one update's forward pass provides them.
        mini = spec.mini_batch_size or batch.size
        kl_in_reward = kl_spec.active and kl_spec.placement == "reward"
        need_old = spec.num_iterations > 1 or mini < batch.size or kl_in_reward
        started = time.perf_counter()
        old: torch.Tensor | None = None
        old_entropy: torch.Tensor | None = None
        ref: torch.Tensor | None = None
        if need_old:
            old, old_entropy = self._forward(self.model, batch, with_entropy=True)
        if self.ref_model is not None:
            ref, _ = self._forward(self.ref_model, batch)
        logprob_time = time.perf_counter() - started

        if kl_in_reward and old is not None and ref is not None:
            per_token = kl_math.per_token_kl(kl_spec.estimator, old, ref)
            shaped -= kl_math.kl_reward_penalty(per_token, batch.mask, kl_spec.beta)
        adv = group_advantages(shaped.view(-1, g_size), spec.advantage_scale).view(-1)

        started = time.perf_counter()
        stats, pre = run_updates(
            self.model,
            self.optimizer,
            batch,
            adv,
            spec=spec,
            step=step,
            seed=self.config.seed,
            old_logprobs=old,
            ref_logprobs=ref,
            pad_id=self.pad_id,
            guard=self.guard,
            collect_pre_update=not need_old,
        )
        update_time = time.perf_counter() - started
        sync_time = 0.0
        if stats.updates > stats.skipped:
            assert self.engine is not None
            sync_time = self.engine.sync_weights(self.model)

        metrics.update(update_metrics(stats, adv))
        metrics["time/reward"] += reward_time
        metrics["time/logprobs"] = logprob_time
        metrics["time/update"] = update_time
        metrics["time/weight_sync"] = sync_time
        metrics.update(
            token_metrics(
                batch.mask,
                # Pre-update trainer values: from the old-logprob pass, or from the single
                # update's own forward pass (which ran before its optimizer step).
                logprobs=old if old is not None else (pre.logprobs if pre else None),
                entropy=old_entropy if old is not None else (pre.entropy if pre else None),
                engine_logprobs=batch.engine_logprobs,
                ref_logprobs=ref,
                estimator=kl_spec.estimator,
            )
        )
        values = adv.tolist()
        return {i: values[i * g_size : (i + 1) * g_size] for i in range(len(col.kept))}

    def _forward(
        self, model: nn.Module, batch: Batch, *, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return forward_logprobs(
            model,
            batch,
            micro_batch_size=self.spec.micro_batch_size,
            temperature=self.spec.temperature,
            pad_id=self.pad_id,
            with_entropy=with_entropy,
        )

    def _evaluate(self, step: int) -> float:
        assert self.engine is not None
        rows = self.eval_rows[: len(self.eval_ids)]
        results = self.engine.generate(
            self.eval_ids,
            1,
            max_new_tokens=self.spec.max_new_tokens,
            temperature=self.spec.temperature,
            seed=derive_seed(self.config.seed, step, _EVAL_SEED_SALT),
            greedy=True,
        )
        totals, _ = self.graders.score([r[0].text for r in results], [x.answer for x in rows])
        accuracy = eval_accuracy(totals, self.graders.max_total)
        self.cb.on_event(
            "eval",
            f"step {step}: eval accuracy {accuracy:.3f} on {len(rows)} rows",
            data={"step": step, "accuracy": accuracy, "rows": len(rows)},
        )
        return accuracy


def _to_device(module: nn.Module, device: torch.device) -> None:
    module.to(device)
