"""Starting a run's rollout server: :func:`start_remote_engine` sizes the server as
:func:`trainer.rollout.startup.start_engine` sizes an in-process engine and returns the
:class:`~trainer.rollout.remote_engine.RemoteEngine` that owns it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from jobspec import JobSpec
from jobspec.traits import ROLLOUT_ENGINE_TRAITS
from trainer.rollout.remote_engine import RemoteEngine
from trainer.rollout.rollout_server import config_for_run

__all__ = ["RunFacts", "start_remote_engine"]


class RunFacts(Protocol):
    """What :func:`start_remote_engine` reads of a run (``trainer.run.setup.RunSetup``)."""

    config: JobSpec
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    model_path: Path | None
    train_ids: list[list[int]]
    eval_ids: list[list[int]]

    @property
    def engine_model(self) -> nn.Module: ...


def start_remote_engine(
    setup: RunFacts,
    *,
    device: torch.device | None = None,
    threads: int | None = None,
    cpus: Sequence[int] | None = None,
    **options: Any,
) -> RemoteEngine:
    """The rollout server of a run (``setup``: its spec, model folder, tokenizer, prompts),
    sized as :func:`trainer.rollout.startup.start_engine` sizes an in-process engine: the
    context of the longest call, a vLLM KV cache for the run's largest generate call, the end
    tokens the run declares. ``device`` (default: the run's), ``threads`` and ``cpus`` are
    the server's own; ``options`` go to :class:`RemoteEngine`."""
    from jobspec.memory_terms import kv_block_tokens
    from trainer.rollout.base import model_context_tokens
    from trainer.rollout.startup import max_model_len, run_kv_cache_bytes
    from trainer.rollout.stop_tokens import stop_token_ids

    if setup.model_path is None:
        raise ValueError("a rollout server loads the model from its folder (config.model)")
    spec, where = setup.config, device or setup.device
    model = setup.engine_model
    context = model_context_tokens(getattr(model, "config", None), setup.tokenizer)
    block = kv_block_tokens(where.type)
    sized = ROLLOUT_ENGINE_TRAITS[spec.rollout.engine].sizes_kv_cache
    config = config_for_run(
        spec,
        setup.model_path,
        device=where,
        max_model_len=max_model_len(spec, context),
        kv_cache_bytes=run_kv_cache_bytes(
            spec, model, setup.train_ids, setup.eval_ids, block, context, device_type=where.type
        )
        if sized
        else None,
        kv_block_tokens=block,
        threads=threads,
        cpus=cpus,
    )
    config.stop_token_ids = list(stop_token_ids(setup.tokenizer, model=model))
    return RemoteEngine(config, **options)
