"""The checkpoint's waits are bounded by its size, not the world's timeout: rank 0 writing a
7B full fine-tune's float32 weights outlasts 600 s at a conservative disk speed, so the ranks
wait for it in a gloo group of their own whose timeout scales with the bytes written."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from jobspec import LoraSpec
from trainer.distributed import world as world_module
from trainer.distributed.timeout import checkpoint_timeout_s
from trainer.distributed.world import World
from trainer.models.loading import load_policy, resolve_model
from trainer.models.lora import apply_lora
from trainer.run import checkpoints as checkpoints_module
from trainer.run.checkpoints import RunCheckpoints, checkpoint_bytes

GB = 1e9


def test_a_small_checkpoint_keeps_the_worlds_timeout() -> None:
    assert checkpoint_timeout_s(600.0, 0) == 600.0
    assert checkpoint_timeout_s(600.0, 63e6 * 4) == 600.0  # a 7B LoRA: adapters and Adam


def test_a_7b_full_fine_tune_gets_twice_its_write_time_at_200_mb_per_s() -> None:
    # float32 weights twice (the ranks' shards, rank 0's Hugging Face folder) + Adam's moments
    written = 2 * 28 * GB + 56 * GB
    assert checkpoint_timeout_s(600.0, written) == pytest.approx(112 * GB / 200e6 * 2)  # 1120 s
    assert checkpoint_timeout_s(600.0, 2 * written) == pytest.approx(2240.0)
    assert checkpoint_timeout_s(600.0, written, disk_bytes_per_s=1e9, margin=1) == 600.0


def test_nonsense_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        checkpoint_timeout_s(600.0, -1)
    with pytest.raises(ValueError):
        checkpoint_timeout_s(600.0, 1, disk_bytes_per_s=0)


def _stepped(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 40, (1, 6), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return optimizer


def test_checkpoint_bytes_counts_trainable_weights_twice_and_the_optimizer_state() -> None:
    model, _ = load_policy(resolve_model("tiny-random-llama"))
    optimizer = _stepped(model)
    weights = sum(p.numel() * 4 for p in model.parameters())  # float32, tied ones once
    steps = sum(s["step"].numel() * s["step"].element_size() for s in optimizer.state.values())
    assert checkpoint_bytes(model, optimizer) == 2 * weights + 2 * weights + steps

    base, _ = load_policy(resolve_model("tiny-random-llama"))
    lora = apply_lora(base, LoraSpec(rank=4, target_modules=["q_proj", "v_proj"]))
    adapters = sum(p.numel() * 4 for p in lora.parameters() if p.requires_grad)
    lora_bytes = checkpoint_bytes(lora, _stepped(lora))
    assert 4 * adapters <= lora_bytes < 4 * adapters + 1000  # the base is not written


class _Work:
    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log

    def wait(self, timeout: timedelta) -> bool:
        self.log.append(("wait", timeout))
        return True


@pytest.fixture()
def fake_dist(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """torch.distributed as the world calls it, recording: groups made, barriers, waits."""
    log: list[tuple[str, Any]] = []
    dist = world_module.dist

    def new_group(**kw: Any) -> str:
        log.append(("new_group", kw))
        return "patient-group"

    def barrier(group: Any = None, async_op: bool = False) -> _Work:
        log.append(("barrier", group))
        return _Work(log)

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "barrier", barrier)
    monkeypatch.setattr(dist, "destroy_process_group", lambda g: log.append(("destroy", g)))
    return log


def test_a_patient_barrier_waits_in_its_own_group_with_its_own_timeout(
    fake_dist: list[tuple[str, Any]],
) -> None:
    world = World(rank=1, size=2, timeout_s=60.0)
    world.barrier("update")
    with world.patient_group(1120.0) as patient:
        assert patient is not None
        world.barrier("checkpoint", patient)
    assert fake_dist == [
        ("barrier", None),
        ("wait", timedelta(seconds=60)),
        ("new_group", {"backend": "gloo", "timeout": timedelta(seconds=1120)}),
        ("barrier", "patient-group"),
        ("wait", timedelta(seconds=1120)),
        ("destroy", "patient-group"),
    ]


def test_a_patient_group_never_waits_less_than_the_world() -> None:
    with World(timeout_s=60.0).patient_group(1e6) as none:
        assert none is None  # a single rank runs no collective


def test_the_ranks_wait_for_rank_0s_write_in_the_patient_group(
    fake_dist: list[tuple[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A rank other than 0 writes its shards and waits for rank 0's folder in a group whose
    timeout is the checkpoint's, computed from the model and optimizer it saves."""
    model, _ = load_policy(resolve_model("tiny-random-llama"))
    optimizer = _stepped(model)
    world = World(rank=1, size=2, timeout_s=1e-3)
    # Rank 0's folder, as its broadcast brings it.
    monkeypatch.setattr(
        world_module.dist, "broadcast_object_list", lambda box, src: box.__setitem__(0, tmp_path)
    )
    sharded: list[Any] = []
    monkeypatch.setattr(checkpoints_module, "save_sharded", lambda *a: sharded.append(a[-1]))
    setup = SimpleNamespace(
        world=world,
        model=model,
        optimizer=optimizer,
        output_dir=tmp_path,
        mirror=SimpleNamespace(gather_for_main=lambda model: None),
        guard=SimpleNamespace(streak=0),
        config=SimpleNamespace(
            checkpoint=SimpleNamespace(keep_best_by=None),
            grpo=SimpleNamespace(async_=SimpleNamespace(max_staleness=0)),  # recorded: K
        ),
    )
    path = RunCheckpoints(setup).save(1, {})  # type: ignore[arg-type]

    assert path == tmp_path / "checkpoint-000001"
    expected = timedelta(seconds=checkpoint_timeout_s(1e-3, checkpoint_bytes(model, optimizer)))
    assert expected > timedelta(seconds=1e-3)
    assert fake_dist == [
        ("new_group", {"backend": "gloo", "timeout": expected}),
        ("barrier", "patient-group"),
        ("wait", expected),
        ("destroy", "patient-group"),
    ]
    assert sharded == ["patient-group"]  # DCP's collectives wait in it too


def test_only_rank_0_makes_the_whole_weights_for_a_checkpoint() -> None:
    """Before a multi-rank checkpoint every rank runs the same gathers, but only rank 0 keeps
    them (its lazy mirror made whole in host memory); another rank's mirror stays a meta
    skeleton: no float32 host copy on every rank of a node. (Plain tensors here: no
    collective; the gathers' order is tests/trainer/distributed/test_streaming.py's.)"""
    from trainer.distributed.weights import Mirror
    from trainer.models.loading import load_policy, resolve_model

    model, _ = load_policy(resolve_model("tiny-random-llama"))
    main = Mirror.skeleton_of(model, World(rank=0, size=2))
    other = Mirror.skeleton_of(model, World(rank=1, size=2))
    for mirror in (main, other):
        mirror.gather_for_main(model)
        assert mirror.fresh
    assert not other.materialised
    assert main.materialised
    for name, value in model.state_dict().items():
        assert torch.equal(main.model.state_dict()[name], value), name
    other.mark_stale()
    other.gather_for_main(model)  # gathers again after an update, still keeps nothing
    assert other.fresh and not other.materialised
