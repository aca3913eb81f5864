"""The CUDA process group, built on CPU by asserting what would be built: its backend map holds
a CPU backend (the trainer all-reduces host float64 sums every update, which an NCCL-only group
refuses), and ``init_world`` binds the group to the rank's own GPU."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from trainer.distributed import world as world_module
from trainer.distributed.world import (
    World,
    init_world,
    process_group_backend,
    process_group_kwargs,
)


def _device_backends(backend: str) -> dict[str, str]:
    """Torch's own reading of a backend string: the backend of each device type."""
    return dict(BackendConfig(dist.Backend(backend)).get_device_backend_map())


def test_a_cuda_group_has_a_cpu_backend_beside_nccl() -> None:
    backends = _device_backends(process_group_backend(torch.device("cuda", 1)))
    assert backends == {"cpu": "gloo", "cuda": "nccl"}


def test_a_cpu_group_is_gloo() -> None:
    assert process_group_backend(torch.device("cpu")) == "gloo"
    kwargs = process_group_kwargs(World(rank=0, size=2), torch.device("cpu"))
    assert kwargs["backend"] == "gloo" and "device_id" not in kwargs


def test_init_world_on_cuda_1_binds_the_group_to_that_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(world_module.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        world_module.dist, "init_process_group", lambda **kw: calls.append(("init", kw))
    )
    monkeypatch.setattr(
        world_module.torch.cuda, "set_device", lambda device: calls.append(("set_device", device))
    )
    world = World(rank=1, size=2, local_rank=1, timeout_s=42.0)
    init_world(world, world.device("cuda"))

    assert [name for name, _ in calls] == ["set_device", "init"]
    assert calls[0][1] == torch.device("cuda", 1)
    kwargs = calls[1][1]
    assert _device_backends(kwargs["backend"])["cpu"] == "gloo"
    assert kwargs["device_id"] == torch.device("cuda", 1)
    assert kwargs["rank"] == 1 and kwargs["world_size"] == 2
    assert kwargs["timeout"] == timedelta(seconds=42)
