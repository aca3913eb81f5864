"""Two ranks whose weight gathers disagree: ``torchrun ... out_of_order.py``.

Rank 1 walks the sharded model's tensors in reverse, as a rank that skipped or reordered a
gather would; each rank prints the error it ended with and exits 3 on a DistributedTimeout."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.trainer.conftest import tiny_llama
from trainer.distributed.sharding import mesh_for, shard_model
from trainer.distributed.weights import Mirror
from trainer.distributed.world import DistributedTimeout, init_world, world_from_env


class _Reversed(torch.nn.Module):
    """The sharded model, its state_dict walked backwards."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def state_dict(self, *args: object, **kwargs: object) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return dict(reversed(list(self.inner.state_dict().items())))


def main() -> int:
    world = world_from_env()
    init_world(world, torch.device("cpu"))
    model = tiny_llama(64)
    mirror = Mirror.copy_of(model, world, torch.device("cpu"))
    shard_model(model, mesh_for(world, "cpu"))
    try:
        mirror.refresh(_Reversed(model) if world.rank == 1 else model)
    except DistributedTimeout as exc:
        print(f"DistributedTimeout rank={exc.rank} phase={exc.phase}: {exc}", flush=True)
        return 3
    print("no error", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
