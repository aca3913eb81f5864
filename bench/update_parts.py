"""The pieces of one GRPO update run on a random model of given shapes, shared by
``bench.gpu_update`` (on a GPU) and ``bench.head_memory`` (on CPU): the model configs, the
policy, the fixed batch, the output-head selection and the timed updates."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, Qwen2Config

from jobspec import GRPOSpec, LoraSpec
from jobspec.memory_plan import PlanInputs, plan_memory
from jobspec.model_shape import preset_shape
from trainer.models.loading import disable_dropout, enable_gradient_checkpointing
from trainer.models.lora import apply_lora
from trainer.models.precision import store_frozen_linears_for_autocast
from trainer.update import policy_update
from trainer.update.batch import pack_batch
from trainer.update.logprobs import HeadPath
from trainer.update.optim import build_optimizer
from trainer.update.policy_update import NonFiniteGuard, UpdateInputs, run_updates

HEADS: tuple[HeadPath, ...] = ("fused", "plain")  # the first is the reported one


QWEN25_05B = "Qwen/Qwen2.5-0.5B"


def qwen25_05b_config() -> Qwen2Config:
    """Qwen2.5-0.5B's shapes (494M parameters, tied embeddings), from the one declaration of
    its config the memory plan reads too (``jobspec.model_shape.PRESET_SHAPES``)."""
    shape = preset_shape(QWEN25_05B)
    assert shape is not None
    return Qwen2Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
    )


def tiny_config() -> Qwen2Config:
    """The same architecture at a size a CPU runs in a second (the dry run)."""
    return Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


@dataclass(frozen=True)
class Shape:
    rows: int  # completions in the batch (B)
    prompt_tokens: int  # P, every prompt
    completion_tokens: int  # T, every completion (no end token: random weights)
    micro_batch_size: int


def lora_rank(name: str) -> int | None:
    """``full`` -> None, ``lora16`` -> 16."""
    if name == "full":
        return None
    if name.startswith("lora") and name[4:].isdigit():
        return int(name[4:])
    raise ValueError(f"unknown configuration {name!r}: full or loraN (e.g. lora16)")


def head_name(name: str) -> HeadPath:
    if name not in HEADS:
        raise ValueError(f"unknown head {name!r}: {' or '.join(HEADS)}")
    return cast(HeadPath, name)


@contextlib.contextmanager
def head_path(head: HeadPath) -> Iterator[None]:
    """The update's ``completion_logprobs`` with this output head inside the scope."""
    original = policy_update.completion_logprobs
    policy_update.completion_logprobs = functools.partial(original, head=head)
    try:
        yield
    finally:
        policy_update.completion_logprobs = original


def build_policy(config: Qwen2Config, device: torch.device, rank: int | None) -> nn.Module:
    """A seeded random model of ``config`` in float32 (the master weights) on ``device``,
    dropout off, gradient checkpointing on (the trainer's defaults), LoRA adapters of
    ``rank`` on every linear layer when given (B random, not 0, as after some training)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model: nn.Module = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(device)
    disable_dropout(model)
    enable_gradient_checkpointing(model)
    if rank is not None:
        model = apply_lora(model, LoraSpec(rank=rank, alpha=2 * rank))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.01)
        # As a bfloat16 job does (trainer.run.setup): the frozen base's Linears in bfloat16.
        store_frozen_linears_for_autocast(model, "bfloat16")
    return model


def planned_update_bytes(shape: Shape, rank: int | None, device_memory: int) -> int:
    """What the memory plan (``jobspec.memory_plan``) counts for this update on one device of
    ``device_memory`` bytes: weights, gradients, optimizer state and activations (the bench
    has no engine and no reference). Compared with ``torch.cuda.max_memory_allocated``."""
    inputs = PlanInputs(
        training_dtype="bfloat16",
        lora_rank=rank,
        engine="transformers",
        engine_holds_weights=False,
        micro_batch_size=shape.micro_batch_size,
        sequence_tokens=shape.prompt_tokens + shape.completion_tokens,
        completion_tokens=shape.completion_tokens,
        accelerator="cuda",
    )
    qwen = preset_shape(QWEN25_05B)
    assert qwen is not None
    plan = plan_memory(qwen, inputs, device_memory=device_memory, suggest=False)
    return plan.weights + plan.gradients + plan.optimizer + plan.activations


def grpo_spec(
    shape: Shape, *, gradient_checkpointing: bool = True, dtype: str = "bfloat16"
) -> GRPOSpec:
    """The update's settings: bfloat16 mixed precision (or ``dtype``), one update over the
    batch, no KL."""
    return GRPOSpec.model_validate(
        {
            "dtype": dtype,
            "prompts_per_step": 1,
            "group_size": shape.rows,
            "max_prompt_tokens": shape.prompt_tokens,
            "max_new_tokens": shape.completion_tokens,
            "micro_batch_size": shape.micro_batch_size,
            "gradient_checkpointing": gradient_checkpointing,
            "learning_rate": 1e-6,
        }
    )


def fixed_batch(config: Qwen2Config, shape: Shape, device: torch.device) -> tuple[Any, Tensor]:
    """A seeded batch of random tokens (fixed lengths) and +-1 advantages."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(
        10,
        config.vocab_size,
        (shape.rows, shape.prompt_tokens + shape.completion_tokens),
        generator=generator,
    ).tolist()
    batch = pack_batch(
        [row[: shape.prompt_tokens] for row in ids],
        [row[shape.prompt_tokens :] for row in ids],
        [None] * shape.rows,
        [False] * shape.rows,
        torch.ones(shape.rows),
        device,
    )
    advantages = (torch.randint(0, 2, (shape.rows,), generator=generator) * 2 - 1).float()
    return batch, advantages.to(device)


def timed_updates(
    model: nn.Module,
    spec: GRPOSpec,
    batch: Any,
    advantages: Tensor,
    steps: int,
    head: HeadPath,
    probe: Callable[[str], None] | None = None,
) -> tuple[list[float], list[float]]:
    """One warm-up update (allocations, kernel selection), then ``steps`` timed ones with the
    ``head`` output head: (seconds, policy losses) of the timed ones. ``probe`` is called with
    ``"update"`` before each update and ``"optimizer"`` before each optimizer step."""
    optimizer = build_optimizer(model, spec)
    if probe is not None:
        optimizer_step = optimizer.step

        def probed_step(*args: Any, **kwargs: Any) -> Any:
            probe("optimizer")
            return optimizer_step(*args, **kwargs)

        optimizer.step = probed_step  # type: ignore[method-assign]
    device = advantages.device
    times, losses = [], []
    with head_path(head):
        for step in range(steps + 1):
            if probe is not None:
                probe("update")
            synchronize(device)
            start = time.perf_counter()
            stats, _ = run_updates(
                UpdateInputs(
                    model=model,
                    optimizer=optimizer,
                    batch=batch,
                    advantages=advantages,
                    step=step,
                    seed=0,
                    old_logprobs=None,
                    ref_logprobs=None,
                    pad_id=0,
                    guard=NonFiniteGuard(lambda *args, **kwargs: None),
                    collect_pre_update=False,
                ),
                spec,
            )
            synchronize(device)
            if step > 0:
                times.append(time.perf_counter() - start)
                losses.append(stats.policy_loss)
    return times, losses


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
