"""The run's rollout engine around an update: asleep while the trainer needs the device memory
its KV cache holds (vLLM on a GPU), awake and given the updated weights afterwards.

On several ranks the weights go to the rank's own engine as they are gathered
(:mod:`trainer.distributed.weights`): bucket by bucket, in the engine's dtype, each bucket
handed on only once every rank finished its gathers, and no rank holds a full copy. An engine
that takes buckets (``load_weight_buckets``, :class:`trainer.rollout.base.StreamedSync`) gets
them straight from the gathers. The transformers engine generates with the rank's eager
mirror, which is refreshed the same way. An engine that takes only a module (``sync_weights``)
gets the lazy mirror, made whole in host memory: the fallback until it takes buckets."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from trainer.distributed.weights import WeightView, engine_buckets
from trainer.rollout.base import RolloutEngine, streamed_sync, torch_dtype
from trainer.rollout.startup import StartedEngine, engine_dtype

if TYPE_CHECKING:
    from trainer.run.setup import RunSetup

__all__ = ["engine_view", "push_initial_weights", "sleep_engine", "sync_engine", "wake_engine"]


def sleep_engine(started: StartedEngine) -> int | None:
    """Put a sleep-capable engine (vLLM on a GPU) to sleep for the update; its level (None:
    it stays awake)."""
    plan = started.colocation
    sleep = getattr(started.engine, "sleep", None)
    if plan is None or plan.sleep_level is None or not callable(sleep):
        return None
    sleep(plan.sleep_level)
    return plan.sleep_level


def engine_view(setup: RunSetup) -> WeightView:
    """What the engine is given of a sharded policy: the adapter alone when the spec serves
    LoRA adapters (``rollout.lora_sync: adapter``), else the merged weights."""
    if setup.config.lora is not None and setup.config.rollout.lora_sync == "adapter":
        return "adapter"
    return "merged"


def sync_engine(setup: RunSetup, engine: RolloutEngine) -> float:
    """Give ``engine`` the policy's current weights; seconds spent (gathers included). Every
    rank calls it at the same point."""
    mirror = setup.mirror
    if mirror is None:  # one process: the engine reads the policy itself
        return engine.sync_weights(setup.model)
    clock = time.perf_counter()
    streamed = streamed_sync(engine)
    if mirror.lazy and streamed is not None:
        view = engine_view(setup)
        buckets = engine_buckets(
            setup.model,
            setup.world,
            view=view,
            dtype=torch_dtype(engine_dtype(setup.config, setup.device)),
            bucket_bytes=mirror.bucket_bytes,
        )
        # The adapter's peft config goes with its tensors: an adapter folder needs both.
        peft_configs = getattr(setup.model, "peft_config", None) or {}
        config = peft_configs.get("default") if view == "adapter" else None
        streamed.load_weight_buckets(buckets, adapter_config=config)
        return time.perf_counter() - clock
    mirror.ensure_fresh(setup.model)
    return time.perf_counter() - clock + engine.sync_weights(mirror.model)


def wake_engine(setup: RunSetup, started: StartedEngine, must_sync: bool) -> float:
    """Wake a sleeping engine and, when ``must_sync``, sync the policy's weights into it; the
    sync's seconds (0 without one)."""
    engine = started.engine
    wake = getattr(engine, "wake", None)
    if callable(wake):
        wake()
    if not must_sync:
        return 0.0
    return sync_engine(setup, engine)


def push_initial_weights(setup: RunSetup, started: StartedEngine, resuming: bool) -> float:
    """Give the engine the policy's weights where it may not hold them yet; seconds spent. A
    built engine holds the weights it was built from: push restored ones before any rollout.
    A caller's engine may hold anything: always push."""
    if resuming or not started.owned:
        return sync_engine(setup, started.engine)
    return 0.0
