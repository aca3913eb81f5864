"""The run's callbacks as every rank sees them: rank 0 calls the real ones, the other ranks
call none, and a stop request is rank 0's answer broadcast to every rank.

``should_stop`` is polled at the same points on every rank (between steps, between rollout
rounds), so the broadcast pairs up across ranks and every rank stops at the same step
boundary: a rank that stopped alone would leave its peers waiting in the next collective.
"""

from __future__ import annotations

from pathlib import Path

from trainer.distributed.world import World
from trainer.run.callbacks import Callbacks, RolloutSample, RunInfo

__all__ = ["RankCallbacks", "rank_callbacks"]


class RankCallbacks(Callbacks):
    """``inner`` on rank 0; nothing on the others; ``should_stop`` agreed by every rank."""

    def __init__(self, inner: Callbacks, world: World) -> None:
        self.inner = inner
        self.world = world
        self.applies_retention = inner.applies_retention

    def on_start(self, info: RunInfo) -> None:
        if self.world.is_main:
            self.inner.on_start(info)

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if self.world.is_main:
            self.inner.on_step(step, metrics)

    def on_event(
        self, kind: str, message: str, level: str = "info", data: dict[str, object] | None = None
    ) -> None:
        if self.world.is_main:
            self.inner.on_event(kind, message, level, data)

    def on_samples(self, step: int, samples: list[RolloutSample]) -> None:
        if self.world.is_main:
            self.inner.on_samples(step, samples)

    def on_checkpoint(self, step: int, path: Path) -> None:
        if self.world.is_main:
            self.inner.on_checkpoint(step, path)

    def should_stop(self) -> bool:
        asked = self.inner.should_stop() if self.world.is_main else False
        return bool(self.world.broadcast_object(asked, "stop"))


def rank_callbacks(callbacks: Callbacks, world: World) -> Callbacks:
    """``callbacks`` as this rank calls them (unchanged in a single-rank world)."""
    return RankCallbacks(callbacks, world) if world.distributed else callbacks
