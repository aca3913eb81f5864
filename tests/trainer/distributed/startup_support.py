"""What the start-up order's tests share, on CPU (tests/trainer/distributed/test_startup_order.py)
and on a GPU (tests/gpu/test_gpu_startup_sync.py): a small job's spec and this process as rank 0
of 2 over torch's fake process group."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from jobspec import JobSpec
from trainer.distributed.world import World

__all__ = ["fake_two_ranks", "startup_spec"]


def startup_spec(engine: str = "vllm", devices: int = 2, **grpo: Any) -> JobSpec:
    """A 1-step bf16 job with a k3 KL in the loss (so a reference is built) on ``devices``."""
    return JobSpec.model_validate(
        {
            "model": "tiny-random-llama",
            "dataset": {"rows": [{"prompt": f"say {w}"} for w in "abcd"]},
            "graders": [{"type": "regex", "name": "seven", "pattern": "7"}],
            "grpo": {
                "steps": 1,
                "prompts_per_step": 2,
                "group_size": 2,
                "max_new_tokens": 4,
                "max_prompt_tokens": 16,
                "micro_batch_size": 2,
                "dtype": "bfloat16",
                "kl": {"estimator": "k3", "beta": 0.04, "placement": "loss"},
                **grpo,
            },
            "rollout": {"engine": engine},
            "resources": {"devices": devices},
            "checkpoint_interval": 0,
        }
    )


@pytest.fixture
def fake_two_ranks() -> Iterator[World]:
    """This process as rank 0 of a 2-rank gloo-less world (torch's fake process group)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield World(rank=0, size=2)
    finally:
        dist.destroy_process_group()
