"""The start-up order never holds two float32 copies of the policy, and the engine's memory
share on several ranks keeps room for the rank's trainable parameters (issue 34, item 3).

The multi-rank cases run in this process as rank 0 of 2 over torch's fake process group
(collectives return at once, shapes and sharding are real), which is what building the
pieces needs; numerics across real ranks are in ``test_streaming.py``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from jobspec import JobSpec
from tests.trainer.distributed import startup_support
from tests.trainer.distributed.memory_tracking import LiveBytes, float32_bytes
from trainer.distributed.world import World
from trainer.models.loading import load_policy, resolve_model
from trainer.rollout import startup
from trainer.rollout.colocation import (
    engine_memory_share,
    trainable_params_on_rank,
    update_reserve_bytes,
)
from trainer.run.callbacks import Callbacks
from trainer.run.setup import Given, prepare_run, start_run_engine

fake_two_ranks = startup_support.fake_two_ranks  # the fixture, shared with the other tier


def _peak_over_policy(spec: JobSpec, tmp_path: Path, world: World | None) -> tuple[int, int]:
    """(peak live float32 bytes during prepare_run beyond the policy's own, the policy's
    float32 bytes); the policy is loaded before tracking and handed over as the caller's."""
    model, tokenizer = load_policy(resolve_model(spec.model), dtype=torch.float32)
    policy_bytes = float32_bytes(model)
    tracker = LiveBytes(torch.float32)
    tracker.adopt([*model.parameters(), *model.buffers()])
    given = Given(model=model, tokenizer=tokenizer)
    with tracker:
        setup = prepare_run(spec, Callbacks(), tmp_path, torch.device("cpu"), given, world)
    assert setup.reference is not None
    return tracker.peak - policy_bytes, policy_bytes


def test_one_rank_start_up_never_copies_the_float32_policy(tmp_path: Path) -> None:
    # The bfloat16 reference keeps only embeddings and norms in float32 (a few percent of
    # this model); a float32 deep copy of the policy first (then cast) doubles the peak.
    beyond, policy = _peak_over_policy(startup_support.startup_spec("transformers"), tmp_path, None)
    assert beyond < 0.5 * policy, (beyond, policy)


def test_several_ranks_start_up_never_copies_the_float32_policy(
    tmp_path: Path, fake_two_ranks: World
) -> None:
    # vLLM: no mirror at all (a meta skeleton); the reference is built from the host weights
    # in its dtype and sharded, then the policy is sharded.
    beyond, policy = _peak_over_policy(
        startup_support.startup_spec("vllm"), tmp_path, fake_two_ranks
    )
    assert beyond < 0.5 * policy, (beyond, policy)


def test_several_ranks_end_with_shards_and_no_whole_copy(
    tmp_path: Path, fake_two_ranks: World
) -> None:
    spec = startup_support.startup_spec("vllm")
    setup = prepare_run(spec, Callbacks(), tmp_path, torch.device("cpu"), Given(), fake_two_ranks)
    assert setup.mirror is not None and setup.mirror.lazy and not setup.mirror.materialised
    whole = sum(p.numel() for p in setup.model.parameters())
    assert trainable_params_on_rank(setup.model) <= whole // 2 + 1024  # its shards only
    # The reference is sharded too, its decoder Linear weights in bfloat16.
    assert setup.reference is not None
    dtypes = {p.dtype for p in setup.reference.model.parameters()}
    assert dtypes == {torch.float32, torch.bfloat16}


def test_the_engine_share_on_several_ranks_counts_the_rank_s_trainable_shards(
    tmp_path: Path, fake_two_ranks: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = startup_support.startup_spec("vllm")
    setup = prepare_run(spec, Callbacks(), tmp_path, torch.device("cpu"), Given(), fake_two_ranks)
    calls: list[str] = []
    total, free = 80 << 30, 60 << 30

    def mem_get_info(device: object = None) -> tuple[int, int]:
        calls.append("mem_get_info")
        return free, total

    built: dict[str, Any] = {}

    def make_engine(*args: object, **kwargs: Any) -> object:
        built.update(kwargs)
        return object()

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(startup, "make_engine", make_engine)
    on_cuda = dataclasses.replace(setup, device=torch.device("cuda", 0))
    start_run_engine(on_cuda)

    # The start-up's freed blocks go back before the free memory is read.
    assert calls == ["empty_cache", "mem_get_info"]
    trainable = trainable_params_on_rank(setup.model)
    assert trainable > 0  # the frozen mirror would count 0
    config: Any = setup.model.config
    reserve = update_reserve_bytes(
        trainable_params=trainable,
        micro_batch_tokens=spec.grpo.micro_batch_size * spec.grpo.sequence_tokens,
        hidden_size=config.hidden_size,
        layers=config.num_hidden_layers,
        gradient_checkpointing=spec.grpo.gradient_checkpointing,
        optimizer_allocated=False,
    )
    share = engine_memory_share(total_bytes=total, free_bytes=free, reserve_bytes=reserve)
    assert built["engine_options"]["gpu_memory_utilization"] == pytest.approx(share, rel=1e-12)
