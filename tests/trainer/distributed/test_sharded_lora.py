"""A multi-rank LoRA checkpoint's ``sharded/`` holds the adapters and their optimizer state, no
frozen base weight (the base is rebuilt from the base model at resume), and loads them back
exactly: into the sharded policy of a one-rank gloo group as a resume does, and into a plain
model in one process as ``load_checkpoint`` does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from jobspec import LoraSpec
from trainer.checkpoint.sharded import load_sharded, save_sharded
from trainer.distributed import weights as weights_module
from trainer.distributed.sharding import full_value, shard_model
from trainer.distributed.weights import Mirror
from trainer.distributed.world import World
from trainer.models.loading import load_policy, resolve_model
from trainer.models.lora import apply_lora


@pytest.fixture()
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A default gloo process group of one rank, as ``init_world`` makes one on CPU."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _lora_policy(sharded: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The tiny Llama with adapters on q/v (FSDP2-sharded over the group when ``sharded``)
    and AdamW over its trainable parameters, as ``prepare_run`` builds them."""
    model, _ = load_policy(resolve_model("tiny-random-llama"))
    lora = apply_lora(model, LoraSpec(rank=4, target_modules=["q_proj", "v_proj"]))
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh

        shard_model(lora, init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    return lora, optimizer


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: full_value(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad
    }


def _moments(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Adam's first and second moments by parameter name, whole."""
    out = {}
    for name, p in model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            if key in ("exp_avg", "exp_avg_sq"):
                out[f"{name}.{key}"] = full_value(value).clone()
    return out


def _saved_tensor_keys(folder: Path) -> set[str]:
    """The names of the tensors DCP wrote into ``folder``."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {k for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}


def test_a_lora_sharded_checkpoint_holds_no_frozen_weight_and_restores_the_adapters(
    one_rank: None, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model, optimizer = _lora_policy(sharded=True)
    _train_step(model, optimizer)
    folder = tmp_path / "sharded"
    save_sharded(folder, model, optimizer)

    trainable = _trainable(model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and frozen
    # Every tensor saved is an adapter or Adam's state of one (the rest of DCP's metadata is
    # the optimizer's hyperparameters, bytes).
    expected = {f"model.{name}" for name in trainable} | {
        f"optimizer.state.{name}.{stat}"
        for name in trainable
        for stat in ("step", "exp_avg", "exp_avg_sq")
    }
    assert _saved_tensor_keys(folder) == expected
    expected_moments = _moments(model, optimizer)
    assert len(expected_moments) == 2 * len(trainable)

    # A resume: a fresh sharded policy, its base from the base model, the adapters from disk.
    fresh, fresh_optimizer = _lora_policy(sharded=True)
    load_sharded(folder, fresh, fresh_optimizer)
    got = _trainable(fresh)
    assert got.keys() == trainable.keys()
    for name, value in trainable.items():
        assert torch.equal(got[name], value), name
    got_moments = _moments(fresh, fresh_optimizer)
    assert got_moments.keys() == expected_moments.keys()
    for name, value in expected_moments.items():
        assert torch.equal(got_moments[name], value), name
    # The frozen base is the base model's, untouched by the load.
    base = dict(fresh.named_parameters())
    for name in frozen:
        assert not base[name].requires_grad
    # ... and equal to the trained model's base (which never changed).
    trained_base = dict(model.named_parameters())
    for name in frozen:
        assert torch.equal(full_value(base[name].detach()), full_value(trained_base[name].detach()))

    # One process reads it too (load_checkpoint's path for a multi-rank checkpoint).
    dist.destroy_process_group()
    plain, plain_optimizer = _lora_policy(sharded=False)
    load_sharded(folder, plain, plain_optimizer)
    for name, value in _trainable(plain).items():
        assert torch.equal(value, trainable[name]), name
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store2"), 1), rank=0, world_size=1
    )  # for the fixture's teardown


def test_a_lora_checkpoints_mirror_gathers_and_holds_the_adapters_alone(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 45: rank 0's lazy mirror (what it writes a checkpoint's Hugging Face folder from)
    gathered a LoRA policy's frozen base too and held it in host memory (30 GB at 7B) though
    the folder holds the adapters alone. Now only the adapters are gathered and materialised;
    the base stays on meta, and the folder written from the mirror has the trained adapters."""
    torch.manual_seed(0)
    host, _ = _lora_policy(sharded=False)
    mirror = Mirror.skeleton_of(host, World())  # as setup takes it, before sharding
    model, optimizer = (
        host,
        torch.optim.AdamW([p for p in host.parameters() if p.requires_grad], lr=1e-2),
    )
    from torch.distributed.device_mesh import init_device_mesh

    shard_model(model, init_device_mesh("cpu", (1,)))
    _train_step(model, optimizer)
    mirror.mark_stale()

    gathered: list[str] = []
    real = weights_module.whole_tensors

    def recording(*args: object, **kwargs: object) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in real(*args, **kwargs):  # type: ignore[arg-type]
            gathered.append(name)
            yield name, tensor

    monkeypatch.setattr(weights_module, "whole_tensors", recording)
    mirror.gather_for_main(model)

    trainable = _trainable(model)
    assert sorted(gathered) == sorted(trainable)  # no frozen weight crossed ranks
    held = dict(mirror.model.named_parameters())
    for name, param in held.items():
        if name in trainable:
            assert torch.equal(param, trainable[name]), name
        else:
            assert param.is_meta, name  # never materialised: no host copy of the base
    held_bytes = sum(p.numel() * p.element_size() for p in held.values() if not p.is_meta)
    assert held_bytes == sum(t.numel() * t.element_size() for t in trainable.values())

    folder = tmp_path / "hf"
    mirror.model.save_pretrained(folder)  # what save_checkpoint writes for a LoRA policy
    written = load_file(folder / "adapter_model.safetensors")
    # peft writes an adapter under its parameter's name without the adapter's own name.
    assert written.keys() == {name.replace(".default", "") for name in trainable}
    for name, value in trainable.items():
        assert torch.equal(written[name.replace(".default", "")], value), name
