"""The run's rollout engine around an update: asleep while the trainer needs the device memory
its KV cache holds (vLLM on a GPU), awake and given the updated weights afterwards.

On several ranks every rank first gathers the whole weights into its mirror
(:mod:`trainer.distributed.weights`), and only then talks to its own engine."""

from __future__ import annotations

import time

from trainer.rollout.startup import StartedEngine
from trainer.run.setup import RunSetup

__all__ = ["sleep_engine", "wake_engine"]


def sleep_engine(started: StartedEngine) -> int | None:
    """Put a sleep-capable engine (vLLM on a GPU) to sleep for the update; its level (None:
    it stays awake)."""
    plan = started.colocation
    sleep = getattr(started.engine, "sleep", None)
    if plan is None or plan.sleep_level is None or not callable(sleep):
        return None
    sleep(plan.sleep_level)
    return plan.sleep_level


def wake_engine(setup: RunSetup, started: StartedEngine, must_sync: bool) -> float:
    """Wake a sleeping engine and, when ``must_sync``, sync the policy's weights into it; the
    sync's seconds (0 without one)."""
    engine = started.engine
    wake = getattr(engine, "wake", None)
    if callable(wake):
        wake()
    if not must_sync:
        return 0.0
    if setup.mirror is None:
        return engine.sync_weights(setup.model)
    clock = time.perf_counter()
    setup.mirror.ensure_fresh(setup.model)
    return time.perf_counter() - clock + engine.sync_weights(setup.mirror.model)
