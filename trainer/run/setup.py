"""A run's setup, before its first step: everything :func:`trainer.run.loop.train` builds from
the job spec (or takes from its caller) and the step driver then works with.

In order: the output folder (interrupted checkpoint writes swept), the dataset's rows and
held-out split (a bad dataset fails before any model is loaded), the scorer, the seeds, the
policy and its tokenizer, the prompts as token ids, the optimizer, schedule and non-finite
guard, and the KL reference (:func:`prepare_run`); then, once a checkpoint is restored, the
rollout engine (:func:`start_run_engine`, :func:`announce_run`).

The spec the run works with has ``grpo.micro_batch_size`` as a number (``auto`` resolved on the
run's device once the policy is loaded: ``trainer.update.micro_batch``), and with
``grpo.compile`` the placed policy's decoder layers are compiled last
(``trainer.update.compiled`` gives the order and why).

The policy is loaded in host memory, and its copies are made there, tensor by tensor, before it
reaches the device (docs/scaling.md, "Start-up order and memory per rank"): the reference in
its own dtype, then on one rank both move to the device; on several ranks rank 0's weights are
broadcast, and the reference then the policy are sharded, ``fully_shard`` moving one unit at a
time onto the device as shards. The device never holds two float32 copies of the policy.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from transformers import PreTrainedTokenizerBase

from grading.graders import Grader
from jobspec import JobSpec
from trainer.agents import Environment, HttpTools
from trainer.checkpoint.store import sweep_temp_dirs
from trainer.data.dataset import (
    Example,
    PromptSampler,
    RunPrompts,
    dataset_rows,
    prompts_for_run,
    split_holdout,
)
from trainer.distributed.weights import Mirror
from trainer.distributed.world import World
from trainer.models.loading import (
    disable_dropout,
    enable_gradient_checkpointing,
    load_policy,
    resolve_model,
)
from trainer.models.lora import apply_lora
from trainer.models.precision import enable_tf32, store_frozen_linears_for_autocast
from trainer.models.reference import Reference
from trainer.rollout.base import RolloutEngine
from trainer.rollout.startup import StartedEngine, start_engine, with_server_share
from trainer.run.callbacks import Callbacks, RunInfo
from trainer.run.placement import place_policy
from trainer.scoring.rewards import RewardFn, Scorer, resolve_scorer
from trainer.update.compiled import CompileNotSupported, compile_decoder_layers, compile_refusal
from trainer.update.micro_batch import resolve_run_micro_batch
from trainer.update.optim import build_optimizer
from trainer.update.policy_update import NonFiniteGuard
from trainer.update.schedule import make_scheduler

__all__ = [
    "DEFAULT_SAMPLE_GROUPS",
    "Given",
    "RunSetup",
    "announce_run",
    "prepare_run",
    "start_run_engine",
]

DEFAULT_SAMPLE_GROUPS = 2  # rollout groups handed to on_samples each step


@dataclass(frozen=True, kw_only=True)
class Given:
    """What the caller of :func:`~trainer.run.loop.train` supplied instead of the job spec
    (None: build it)."""

    graders: Scorer | Sequence[Grader] | None = None
    reward_fn: RewardFn | None = None
    model: nn.Module | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    engine: RolloutEngine | None = None
    sample_groups: int = DEFAULT_SAMPLE_GROUPS
    # An agent job's http tools and http environment (the worker's operator endpoints)
    http_tools: HttpTools | None = None
    http_environment: Environment | None = None

    def __post_init__(self) -> None:
        if (self.model is None) != (self.tokenizer is None):
            raise ValueError("pass model and tokenizer together (or neither)")
        if self.graders is not None and self.reward_fn is not None:
            raise ValueError("pass graders or reward_fn, not both")
        if self.sample_groups < 0:
            raise ValueError(f"sample_groups must be >= 0, got {self.sample_groups}")


@dataclass
class _Policy:
    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    model_path: Path | None  # None: the caller's model object


@dataclass
class RunSetup:
    """What a run works with from its first step to its last."""

    config: JobSpec
    callbacks: Callbacks
    output_dir: Path
    device: torch.device
    given_engine: RolloutEngine | None  # the caller's engine, left open at the end
    sample_groups: int  # rollout groups handed to on_samples each step
    scorer: Scorer
    model: nn.Module  # the policy (LoRA-wrapped when the spec asks), on ``device``
    tokenizer: PreTrainedTokenizerBase
    model_path: Path | None  # the loaded model's folder; None for a caller's model
    pad_id: int
    train_rows: list[Example]  # the rows whose prompt fits, in dataset order
    train_ids: list[list[int]]  # their prompts as token ids
    eval_rows: list[Example]
    eval_ids: list[list[int]]
    skipped_prompts: int  # rows left out for a prompt over max_prompt_tokens
    sample_prompts: list[str]  # what on_samples shows of each training row: its prompt as written
    sample_answers: list[str | None]
    sampler: PromptSampler
    optimizer: Optimizer
    scheduler: LRScheduler
    guard: NonFiniteGuard
    reference: Reference | None  # the KL reference; None when the KL is off
    world: World  # this rank's place among the job's ranks (a single rank: not distributed)
    # Distributed: the unsharded module of the policy (trainer.distributed.weights.Mirror):
    # the transformers engine generates with it (eager, on the device); for any other engine
    # a meta skeleton, made whole in host memory only if something asks for whole weights.
    mirror: Mirror | None
    shares: int  # the job's devices: how each rollout round's prompts are split

    @property
    def engine_model(self) -> nn.Module:
        """What the rollout engine is built from (its config, a module to generate with): the
        policy, or on several ranks the eager mirror; else the sharded policy itself, whose
        config is the model's (vLLM loads the weights from the model's folder)."""
        if self.mirror is not None and not self.mirror.lazy:
            return self.mirror.model
        return self.model

    @property
    def rollout_model(self) -> nn.Module:
        """The policy as one unsharded module: the policy, or its mirror when it is sharded
        (a lazy mirror is materialised in host memory by this call: whole weights for a
        checkpoint; the engine's sync never needs it, ``trainer.run.engine_sync``)."""
        return self.mirror.model if self.mirror is not None else self.model


def prepare_run(
    config: JobSpec,
    callbacks: Callbacks,
    output_dir: Path,
    device: torch.device,
    given: Given,
    world: World | None = None,
) -> RunSetup:
    """Build the run's pieces from ``config`` (and what the caller ``given``), in order. In a
    distributed ``world`` the policy (and a full fine-tune's reference) are sharded over the
    ranks once built, in the order of the module docstring."""
    world = world or World()
    output_dir.mkdir(parents=True, exist_ok=True)
    for swept in sweep_temp_dirs(output_dir) if world.is_main else []:
        callbacks.on_event("checkpoint", f"removed an interrupted checkpoint write: {swept.name}")

    # Rows first: a bad dataset fails before any model is loaded. (The prompts are tokenized,
    # and too long ones skipped, once the tokenizer is loaded.)
    ds = config.dataset
    train_rows, eval_rows = split_holdout(dataset_rows(ds), ds.holdout)
    scorer = resolve_scorer(given.graders, given.reward_fn, config.graders)
    refusal = compile_refusal(device.type) if config.grpo.compile else None
    if refusal is not None:  # before any model is loaded
        raise CompileNotSupported(f"grpo.compile: {refusal}")
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    policy = _load_policy(config, callbacks, device, given)
    # grpo.micro_batch_size auto becomes a number here, once: the run's spec from now on.
    config = resolve_run_micro_batch(config, policy.model, device, world, callbacks.on_event)
    tok = policy.tokenizer
    pad = tok.pad_token_id
    pad_id = int(pad if pad is not None else tok.eos_token_id or 0)
    prompts = _encode_prompts(config, callbacks, tok, train_rows, eval_rows)
    sampler = PromptSampler(len(prompts.train_rows), seed=config.seed, shuffle=ds.shuffle)
    reference, mirror = place_policy(config, policy.model, world, device)
    if given.engine is None:  # an async job's server: its share, now that the trainer is placed
        config = with_server_share(config, policy.model, device, world.is_main, callbacks.on_event)
    if config.grpo.compile:  # last, on the placed policy (trainer.update.compiled's order)
        layers = compile_decoder_layers(policy.model)
        callbacks.on_event(
            "config",
            f"torch.compile on the policy's {len(layers)} decoder layers: the first steps "
            "pay the compilation",
        )
    optimizer = build_optimizer(policy.model, config.grpo)
    scheduler = make_scheduler(optimizer, config.grpo)
    guard = NonFiniteGuard(callbacks.on_event)
    return RunSetup(
        config=config,
        callbacks=callbacks,
        output_dir=output_dir,
        device=device,
        given_engine=given.engine,
        sample_groups=given.sample_groups,
        scorer=scorer,
        model=policy.model,
        tokenizer=tok,
        model_path=policy.model_path,
        pad_id=pad_id,
        train_rows=prompts.train_rows,
        train_ids=prompts.train_ids,
        eval_rows=prompts.eval_rows,
        eval_ids=prompts.eval_ids,
        skipped_prompts=len(prompts.skipped),
        sample_prompts=[row.display_prompt for row in prompts.train_rows],
        sample_answers=[row.answer for row in prompts.train_rows],
        sampler=sampler,
        optimizer=optimizer,
        scheduler=scheduler,
        guard=guard,
        reference=reference,
        world=world,
        mirror=mirror,
        shares=config.resources.devices,
    )


def _load_policy(
    config: JobSpec, callbacks: Callbacks, device: torch.device, given: Given
) -> _Policy:
    """The policy (the caller's object where it is, or ``config.model`` loaded in host memory
    in float32: the master weights, whatever ``grpo.dtype``) with gradient checkpointing as
    the spec says, wrapped with LoRA adapters when ``config.lora`` asks, and its tokenizer.
    :func:`prepare_run` places it on the device once its copies are taken."""
    model, tokenizer = given.model, given.tokenizer
    model_path: Path | None = None
    if model is None or tokenizer is None:
        model_path = resolve_model(config.model, revision=config.model_revision)
        model, tokenizer = load_policy(model_path, dtype=torch.float32)
    policy = _Policy(model, tokenizer, model_path)
    if disable_dropout(model):
        callbacks.on_event("config", "dropout is off in the update, as in the scoring passes")
    if config.grpo.gradient_checkpointing and not enable_gradient_checkpointing(model):
        callbacks.on_event(
            "config",
            f"{type(model).__name__} cannot recompute activations; "
            "gradient_checkpointing is off for this run",
            level="warning",
        )
    if config.lora is not None:
        # Recorded as the adapter's base: the job's own word for it, never a server path.
        policy.model = apply_lora(model, config.lora, base_name=config.model)
        # The frozen base's Linear weights in the training dtype (exact under autocast).
        store_frozen_linears_for_autocast(policy.model, config.grpo.dtype)
    if enable_tf32(device):
        callbacks.on_event("config", "TF32 matmuls on for float32 work on this device")
    return policy


def _encode_prompts(
    config: JobSpec,
    callbacks: Callbacks,
    tokenizer: PreTrainedTokenizerBase,
    train_rows: list[Example],
    eval_rows: list[Example],
) -> RunPrompts:
    """Training and evaluation prompts as token ids, without the rows whose prompt is over
    ``max_prompt_tokens`` (an event lists them; PromptsTooLong when no training row is left)."""
    prompts = prompts_for_run(
        tokenizer,
        train_rows,
        eval_rows,
        config.dataset,
        config.grpo.max_prompt_tokens,
        eval_max_rows=config.eval.max_rows,
    )
    if prompts.skipped:
        message, data = prompts.skipped_event()
        callbacks.on_event("dataset", message, level="warning", data=data)
    return prompts


def start_run_engine(setup: RunSetup) -> StartedEngine:
    """The engine of ``config.rollout``, started (or the caller's, left open at the end)."""
    if setup.given_engine is not None:
        return StartedEngine(setup.given_engine, None, owned=False)
    return start_engine(
        setup.config,
        setup.model_path,
        setup.tokenizer,
        setup.engine_model,
        setup.train_ids,
        setup.eval_ids,
        setup.device,
        staging_root=setup.output_dir,
        trained=setup.model,
    )


def announce_run(
    setup: RunSetup,
    started: StartedEngine,
    resume_from: Path | None,
    start_step: int,
    sync_seconds: float,
) -> None:
    """Announce the run (``on_start``, the engine's line, the resume and the seconds its
    weights took to reach the engine: ``trainer.run.engine_sync.push_initial_weights``)."""
    config, cb = setup.config, setup.callbacks
    resumed = Path(resume_from) if resume_from is not None else None
    cb.on_start(
        RunInfo(
            total_steps=config.grpo.steps,
            start_step=start_step,
            model_path=setup.model_path,
            output_dir=setup.output_dir,
            device=str(setup.device),
            engine=started.kind(config),
            resumed_from=resumed,
        )
    )
    line = started.describe(config)
    if line is not None:
        cb.on_event("engine", line, data={"kv_cache_bytes": started.kv_cache_bytes})
    if resumed is not None:
        cb.on_event(
            "resume",
            # The folder's name only: a service shows events to users, paths are its own.
            f"resumed from {resumed.name} at step {start_step}; weights pushed to the "
            f"engine in {sync_seconds:.2f}s",
            data={"step": start_step, "checkpoint": resumed.name},
        )
