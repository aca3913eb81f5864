"""``save_state`` then ``load_state`` continues exactly where the session was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.primitives.conftest import new_session, values
from trainer.primitives import Datum, PrimitiveError, ResidentModel
from trainer.primitives.state import OPTIMIZER_FILE, SESSION_FILE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(seed: int) -> list[Datum]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for n in (5, 3):
        tokens = torch.randint(0, 57, (n,), generator=generator).tolist()
        targets = torch.randint(0, 57, (n,), generator=generator).tolist()
        out.append(Datum(tokens, {"target_tokens": targets}))
    return out


def _train(session: ResidentModel, seed: int) -> float:
    result = session.forward_backward(_data(seed), "cross_entropy")
    session.optim_step(learning_rate=1e-2, weight_decay=0.01)
    return result.metrics["loss:sum"]


def test_a_loaded_state_continues_exactly_like_the_uninterrupted_session(
    tiny_path: Path, tmp_path: Path
) -> None:
    straight = new_session(tiny_path, dtype=torch.float64, lora_rank=3, train_mlp=False)
    _train(straight, 0)
    _train(straight, 1)
    straight.save_state(tmp_path / "state")
    assert {p.name for p in (tmp_path / "state").iterdir()} >= {
        "adapter_model.safetensors",
        "adapter_config.json",
        OPTIMIZER_FILE,
        SESSION_FILE,
    }

    resumed = ResidentModel.load_state(tmp_path / "state", tiny_path)
    assert resumed.steps == straight.steps == 2
    # The settings came back with the state (rank 3, no MLP adapters, float64).
    assert values(resumed).keys() == values(straight).keys()
    for seed in (2, 3):
        assert _train(resumed, seed) == _train(straight, seed)
        for a, b in zip(values(resumed).values(), values(straight).values(), strict=True):
            assert a.dtype == torch.float64 and torch.equal(a, b)


def test_a_state_loaded_without_its_optimizer_starts_adam_afresh(
    tiny_path: Path, tmp_path: Path
) -> None:
    straight = new_session(tiny_path, dtype=torch.float64)
    _train(straight, 0)
    straight.save_state(tmp_path / "state")
    fresh = ResidentModel.load_state(tmp_path / "state", tiny_path, optimizer=False)
    assert fresh.steps == 0
    assert all(
        torch.equal(a, b)
        for a, b in zip(values(fresh).values(), values(straight).values(), strict=True)
    )
    _train(fresh, 1)
    _train(straight, 1)
    # Adam's moments and bias correction differ, so the same gradients move the weights otherwise.
    assert any(
        not torch.equal(a, b)
        for a, b in zip(values(fresh).values(), values(straight).values(), strict=True)
    )


def test_saves_never_overwrite_and_leave_no_partial_folder(tiny_path: Path, tmp_path: Path) -> None:
    session = new_session(tiny_path)
    session.save_state(tmp_path / "state")
    with pytest.raises(FileExistsError):
        session.save_state(tmp_path / "state")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]  # no temporary folder left


def test_a_folder_that_is_no_state_is_refused(tiny_path: Path, tmp_path: Path) -> None:
    with pytest.raises(PrimitiveError, match="path: not a saved training state"):
        ResidentModel.load_state(tmp_path, tiny_path)
    session = new_session(tiny_path)
    session.save_state(tmp_path / "state")
    record = json.loads((tmp_path / "state" / SESSION_FILE).read_text())
    record["format"] = 99
    (tmp_path / "state" / SESSION_FILE).write_text(json.dumps(record))
    with pytest.raises(PrimitiveError, match="path: state format 99"):
        ResidentModel.load_state(tmp_path / "state", tiny_path)
