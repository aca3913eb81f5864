from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from jobspec import CheckpointSpec
from trainer.checkpoint.store import (
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    sweep_temp_dirs,
)
from trainer.models.loading import load_policy, resolve_model


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model("tiny-random-llama")


def _setup(model_dir: Path):  # type: ignore[no-untyped-def]
    model, tokenizer = load_policy(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 / (i + 1))
    return model, tokenizer, optimizer, scheduler


def _train_step(model, optimizer, scheduler) -> None:  # type: ignore[no-untyped-def]
    ids = torch.randint(0, 40, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _save(out: Path, step: int, model, tokenizer, optimizer, scheduler, **kw):  # type: ignore[no-untyped-def]
    return save_checkpoint(
        out,
        step,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler={"epoch": 0, "index": step},
        **kw,
    )


def test_round_trip_restores_everything(tmp_path: Path, model_dir: Path) -> None:
    model, tokenizer, optimizer, scheduler = _setup(model_dir)
    torch.manual_seed(0)
    _train_step(model, optimizer, scheduler)
    random.seed(123)
    torch.manual_seed(123)
    path = _save(tmp_path, 1, model, tokenizer, optimizer, scheduler, extra={"streak": 2})
    assert path == checkpoint_path(tmp_path, 1) == tmp_path / "checkpoint-000001"
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    # The draws that follow the save, then the original run goes on (its data uses the RNG).
    expected_py, expected_torch = random.random(), torch.rand(3)
    _train_step(model, optimizer, scheduler)

    # The folder is a plain HF model folder.
    loaded, loaded_tok = load_policy(path)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, weights[key]), key
    assert loaded_tok("abc")["input_ids"] == tokenizer("abc")["input_ids"]

    # Fresh objects restored from the checkpoint continue exactly like the original run.
    fresh_model, _, fresh_opt, fresh_sched = _setup(model_dir)
    state = load_checkpoint(path, fresh_model, fresh_opt, fresh_sched)
    assert state.step == 1 and state.sampler == {"epoch": 0, "index": 1}
    assert state.extra == {"streak": 2}
    assert random.random() == expected_py and torch.equal(torch.rand(3), expected_torch)
    _train_step(fresh_model, fresh_opt, fresh_sched)
    assert fresh_sched.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"] == 2
    assert fresh_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    for (name, a), b in zip(
        model.state_dict().items(), fresh_model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_failed_save_leaves_nothing(tmp_path: Path, model_dir: Path) -> None:
    model, tokenizer, optimizer, scheduler = _setup(model_dir)
    with pytest.raises(TypeError):  # not JSON-serialisable: fails after the tensors are written
        _save(tmp_path, 3, model, tokenizer, optimizer, scheduler, extra={"bad": object()})
    assert list(tmp_path.iterdir()) == []
    assert latest_checkpoint(tmp_path) is None


def test_interrupted_writes_are_ignored_and_swept(tmp_path: Path, model_dir: Path) -> None:
    model, tokenizer, optimizer, scheduler = _setup(model_dir)
    good = _save(tmp_path, 2, model, tokenizer, optimizer, scheduler)
    # What a process killed mid-save or mid-delete leaves behind:
    (tmp_path / ".tmp-checkpoint-000004-deadbeef").mkdir()
    (tmp_path / ".tmp-checkpoint-000004-deadbeef" / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".trash-checkpoint-000001-cafe").mkdir()
    # A folder with the right name but no manifest is not a checkpoint either.
    (tmp_path / "checkpoint-000009").mkdir()
    assert latest_checkpoint(tmp_path) == good
    swept = sweep_temp_dirs(tmp_path)
    assert sorted(p.name for p in swept) == [
        ".tmp-checkpoint-000004-deadbeef",
        ".trash-checkpoint-000001-cafe",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000002", "checkpoint-000009"]
    with pytest.raises(FileNotFoundError, match="manifest"):
        load_checkpoint(tmp_path / "checkpoint-000009", model, optimizer, scheduler)


def test_keeps_only_the_last_checkpoints(tmp_path: Path, model_dir: Path) -> None:
    model, tokenizer, optimizer, scheduler = _setup(model_dir)
    keep = CheckpointSpec(keep_last=3)
    for step in (1, 2, 5, 10, 12):
        _save(tmp_path, step, model, tokenizer, optimizer, scheduler, retention=keep)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5, 10, 12]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-000005",
        "checkpoint-000010",
        "checkpoint-000012",
    ]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-000012"
    # Saving the same step again replaces it atomically.
    _save(
        tmp_path, 12, model, tokenizer, optimizer, scheduler, retention=keep, extra={"again": True}
    )
    state = load_checkpoint(tmp_path / "checkpoint-000012", model, optimizer, scheduler)
    assert state.extra == {"again": True}
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5, 10, 12]


def test_mismatched_model_is_refused(tmp_path: Path, model_dir: Path) -> None:
    model, tokenizer, optimizer, scheduler = _setup(model_dir)
    path = _save(tmp_path, 1, model, tokenizer, optimizer, scheduler)
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="does not match"):
        load_checkpoint(path, other, None, None)  # type: ignore[arg-type]
