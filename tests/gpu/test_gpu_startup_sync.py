"""The GPU tier's part of "Right the first time on GPUs" (issue 34): what one CUDA device can
show of the start-up order, the streamed sync, the engine's device and the process group.
Several ranks and CUDA vLLM are not on the GPU machines; their pieces are asserted on CPU
(tests/trainer/distributed, tests/trainer/rollout/test_vllm_devices.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from jobspec import JobSpec
from tests.trainer.distributed import startup_support
from trainer.distributed.sharding import full_value, shard_model
from trainer.distributed.weights import engine_buckets
from trainer.distributed.world import World, process_group_backend
from trainer.rollout.hf_engine import HFEngine
from trainer.rollout.registry import make_engine
from trainer.rollout.vllm_config import device_kwargs, engine_device, request_seeds
from trainer.run.callbacks import Callbacks
from trainer.run.setup import Given, RunSetup, prepare_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


fake_two_ranks = startup_support.fake_two_ranks  # the fixture, shared with the other tier


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _policy_float32_bytes(model: torch.nn.Module) -> int:
    """The whole policy's float32 bytes (sharded parameters counted whole)."""
    return sum(4 * p.numel() for p in model.parameters())


def _start_up(
    spec: JobSpec, tmp_path: Path, world: World | None = None
) -> tuple[RunSetup, int, int]:
    """prepare_run on the device: (the setup, torch.cuda.max_memory_allocated over it beyond
    what was allocated before, the whole policy's float32 bytes)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(_device())
    base = torch.cuda.memory_allocated(_device())
    setup = prepare_run(spec, Callbacks(), tmp_path, _device(), Given(), world)
    peak = torch.cuda.max_memory_allocated(_device()) - base
    return setup, peak, _policy_float32_bytes(setup.model)


def test_one_rank_start_up_peaks_below_two_float32_policies(tmp_path: Path) -> None:
    """torch.cuda.max_memory_allocated over prepare_run on the device: the float32 policy
    and its bfloat16 reference, never a float32 copy of the policy beside the policy."""
    setup, peak, policy = _start_up(
        startup_support.startup_spec("transformers", devices=1), tmp_path
    )
    assert setup.reference is not None
    assert peak < 1.9 * policy, (peak, policy)


def test_a_rank_of_two_holds_its_shards_at_start_up(tmp_path: Path, fake_two_ranks: World) -> None:
    """Rank 0 of 2 with a vLLM engine: the device holds the rank's shards of the policy and
    reference (FSDP2 moves one unit whole at a time), and no mirror."""
    spec = startup_support.startup_spec("vllm", devices=2)
    setup, peak, policy = _start_up(spec, tmp_path, fake_two_ranks)
    assert setup.mirror is not None and not setup.mirror.materialised
    # The old order held the whole float32 policy, a float32 reference copy and a float32
    # mirror on the device (>= 2x); the rank holds half the policy, half the mostly-bfloat16
    # reference, one unit whole in flight and the broadcast's one tensor (1.24x measured on
    # the H200 for the tiny model, whose root unit is a large share).
    assert peak < 1.5 * policy, (peak, policy)


def test_the_streamed_sync_reaches_the_transformers_engine_on_cuda(tmp_path: Path) -> None:
    """A 1-rank world on the backend map ranks use (NCCL for device tensors): the FSDP2-sharded
    policy's weights, gathered and bucketed in bfloat16, copied into a bfloat16 transformers
    engine on the device, equal the policy's weights."""
    dist.init_process_group(
        backend=process_group_backend(_device()),
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=_device(),
    )
    try:
        world = World()
        setup = prepare_run(
            startup_support.startup_spec("transformers", devices=1),
            Callbacks(),
            tmp_path,
            _device(),
            Given(),
        )
        assert setup.model_path is not None
        engine = make_engine(
            "transformers",
            setup.model_path,
            setup.tokenizer,
            dtype="bfloat16",
            max_model_len=64,
            policy_model=setup.model,
        )
        assert isinstance(engine, HFEngine)
        shard_model(setup.model, init_device_mesh("cuda", (1,)))
        with torch.no_grad():
            for p in setup.model.parameters():
                p.add_(0.5)  # the engine's copy is now stale
        buckets = list(
            engine_buckets(
                setup.model, world, view="state_dict", dtype=torch.bfloat16, bucket_bytes=4096
            )
        )
        assert all(t.dtype == torch.bfloat16 and t.is_cuda for b in buckets for _, t in b)
        assert all(sum(t.numel() * 2 for _, t in b) <= 4096 or len(b) == 1 for b in buckets)
        engine.load_weight_buckets(buckets)
        held = engine._model.state_dict()
        for name, value in setup.model.state_dict().items():
            assert torch.equal(held[name], full_value(value).to(torch.bfloat16)), name
        engine.close()
    finally:
        dist.destroy_process_group()


def test_the_engine_device_and_request_seeds_on_cuda() -> None:
    """A bare ``cuda`` is the current device with its index: the vLLM engine is pinned to
    it (``device_ids``); each request carries a seed of its own."""
    device = engine_device("cuda")
    assert device == _device()
    assert device_kwargs(device) == {"device_ids": [device.index]}
    seeds = request_seeds(7, 4)
    assert len(set(seeds)) == 4 and seeds == request_seeds(7, 4)
