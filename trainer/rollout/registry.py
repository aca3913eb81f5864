"""The rollout engines by name: :data:`ROLLOUT_ENGINES` maps each ``rollout.engine`` of the spec
to a factory, and :func:`make_engine` builds the named engine with the end tokens the model
declares.

The engines' shared interface and helpers are in :mod:`trainer.rollout.base`; each engine's
module builds on it, and each factory here imports its engine's module only when it runs, so
that importing this module never imports vllm. Adding an engine: its module under
``trainer/rollout/``, a factory here, its name in ``jobspec.RolloutEngineName`` and its
traits (what starting it involves) in ``jobspec.traits.ROLLOUT_ENGINE_TRAITS`` (a test
checks the keys equal the spec's names).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from torch import nn
from transformers import PreTrainedTokenizerBase

from jobspec import RolloutEngineName
from trainer.rollout.base import RolloutEngine
from trainer.rollout.stop_tokens import stop_token_ids as declared_stop_token_ids

DEFAULT_KV_BYTES = 2 << 30  # vLLM KV cache when the caller does not size it


class EngineFactory(Protocol):
    """Builds one engine; takes every engine's options and ignores those it has no use for."""

    def __call__(
        self,
        model_path: Path,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dtype: str,
        max_model_len: int,
        policy_model: nn.Module | None,
        kv_cache_bytes: int | None,
        kv_block_tokens: int | None,
        stop_token_ids: Sequence[int],
        lora_rank: int | None,
        engine_options: Mapping[str, Any],
    ) -> RolloutEngine: ...


def _vllm(
    model_path: Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    dtype: str,
    max_model_len: int,
    policy_model: nn.Module | None,
    kv_cache_bytes: int | None,
    kv_block_tokens: int | None,
    stop_token_ids: Sequence[int],
    lora_rank: int | None,
    engine_options: Mapping[str, Any],
) -> RolloutEngine:
    # Imported here so that importing this module never imports vllm.
    from trainer.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(
        model_path,
        tokenizer,
        dtype=dtype,
        max_model_len=max_model_len,
        kv_cache_bytes=kv_cache_bytes if kv_cache_bytes is not None else DEFAULT_KV_BYTES,
        block_tokens=kv_block_tokens,
        stop_token_ids=stop_token_ids,
        lora_rank=lora_rank,
        **engine_options,
    )


def _transformers(
    model_path: Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    dtype: str,
    max_model_len: int,
    policy_model: nn.Module | None,
    kv_cache_bytes: int | None,
    kv_block_tokens: int | None,
    stop_token_ids: Sequence[int],
    lora_rank: int | None,
    engine_options: Mapping[str, Any],
) -> RolloutEngine:
    from trainer.rollout.hf_engine import HFEngine

    if policy_model is None:
        raise ValueError("the transformers engine needs policy_model")
    return HFEngine(
        policy_model,
        tokenizer,
        dtype=dtype,
        max_model_len=max_model_len,
        stop_token_ids=stop_token_ids,
    )


# Keys must equal jobspec.RolloutEngineName and jobspec.traits.ROLLOUT_ENGINE_TRAITS
# (tests/trainer/test_registries.py).
ROLLOUT_ENGINES: dict[RolloutEngineName, EngineFactory] = {
    "vllm": _vllm,
    "transformers": _transformers,
}


def make_engine(
    kind: RolloutEngineName,
    model_path: Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    dtype: str,
    max_model_len: int,
    policy_model: nn.Module | None = None,
    kv_cache_bytes: int | None = None,
    kv_block_tokens: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    lora_rank: int | None = None,
    engine_options: Mapping[str, Any] | None = None,
) -> RolloutEngine:
    """Create the rollout engine named ``kind`` (a key of :data:`ROLLOUT_ENGINES`).

    ``vllm`` loads ``model_path`` into an in-process vLLM engine (call ``sync_weights`` to push
    trained weights) with a KV cache of ``kv_cache_bytes`` (default 2 GiB) in blocks of
    ``kv_block_tokens`` (default: vLLM's); ``transformers`` generates with ``policy_model`` itself
    (required) and ignores both.

    ``lora_rank`` (vllm only): serve LoRA adapters up to that rank, hot-swapped by
    ``sync_weights`` instead of merged weights (``rollout.lora_sync: adapter``).
    ``engine_options`` (vllm only): ``enforce_eager``, ``gpu_memory_utilization``,
    ``sleep_mode`` (``trainer.rollout.colocation``), ``device``: the trainer's device (the
    rank's, or a pinned worker's), which the engine is built on (``trainer.rollout.vllm_config``;
    left out: the current CUDA device, else the CPU).

    Both stop on the same end tokens: ``stop_token_ids``, by default every end token the model
    declares (:func:`trainer.rollout.stop_tokens.stop_token_ids` of ``tokenizer`` and
    ``policy_model``'s generation config, or ``model_path``'s when no model object is given).
    """
    factory = ROLLOUT_ENGINES.get(kind)
    if factory is None:
        raise ValueError(
            f"unknown rollout engine {kind!r}; expected one of {', '.join(ROLLOUT_ENGINES)}"
        )
    if stop_token_ids is None:
        stop_token_ids = declared_stop_token_ids(
            tokenizer,
            model=policy_model,
            model_path=model_path if policy_model is None else None,
        )
    return factory(
        model_path,
        tokenizer,
        dtype=dtype,
        max_model_len=max_model_len,
        policy_model=policy_model,
        kv_cache_bytes=kv_cache_bytes,
        kv_block_tokens=kv_block_tokens,
        stop_token_ids=list(stop_token_ids),
        lora_rank=lora_rank,
        engine_options=dict(engine_options or {}),
    )
