"""``suspend`` then ``resume`` (an idle training client's release and reload) continues exactly
where the resident session was: mid-step, with gradients accumulated and not yet applied, and
with the sampler weights it kept in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.primitives.conftest import new_session, trainable, values
from trainer.primitives import Datum, PrimitiveError, ResidentModel
from trainer.primitives.resident import GRADIENTS_FILE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(seed: int) -> list[Datum]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for n in (6, 2, 4):  # variable lengths
        tokens = torch.randint(0, 57, (n,), generator=generator).tolist()
        targets = torch.randint(0, 57, (n,), generator=generator).tolist()
        out.append(Datum(tokens, {"target_tokens": targets}))
    return out


def _step(session: ResidentModel, seed: int) -> float:
    loss = session.forward_backward(_data(seed), "cross_entropy").metrics["loss:sum"]
    session.optim_step(learning_rate=1e-2, weight_decay=0.01)
    return loss


def test_a_session_suspended_mid_step_continues_bit_for_bit(
    tiny_path: Path, tmp_path: Path
) -> None:
    straight = new_session(tiny_path, dtype=torch.float64)
    _step(straight, 0)
    straight.forward_backward(_data(1), "cross_entropy")  # gradients pending, no step yet
    kept = {"sampler-a": straight.snapshot()}
    straight.suspend(tmp_path / "idle", kept)
    assert (tmp_path / "idle" / GRADIENTS_FILE).is_file()

    resumed, snapshots = ResidentModel.resume(tmp_path / "idle", tiny_path)
    assert resumed.steps == straight.steps == 1
    # The pending gradients came back: the step they make is the same.
    for (name, a), b in zip(trainable(resumed).items(), trainable(straight).values(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        assert torch.equal(a.grad, b.grad), name
    resumed.optim_step(learning_rate=1e-2, weight_decay=0.01)
    straight.optim_step(learning_rate=1e-2, weight_decay=0.01)
    for seed in (2, 3):
        assert _step(resumed, seed) == _step(straight, seed)
    for a, b in zip(values(resumed).values(), values(straight).values(), strict=True):
        assert a.dtype == torch.float64 and torch.equal(a, b)
    # The snapshot is the weights as they were when it was taken, not the current ones.
    assert list(snapshots) == ["sampler-a"]
    for name, tensor in kept["sampler-a"].tensors.items():
        assert torch.equal(snapshots["sampler-a"].tensors[name], tensor)
    prompt = [1, 5, 6]
    sampled = resumed.sample(prompt, 2, max_tokens=4, seed=7, weights=snapshots["sampler-a"])
    expected = straight.sample(prompt, 2, max_tokens=4, seed=7, weights=kept["sampler-a"])
    assert [s.tokens for s in sampled.sequences] == [s.tokens for s in expected.sequences]


def test_a_session_suspended_between_steps_has_no_gradient_after_resume(
    tiny_path: Path, tmp_path: Path
) -> None:
    session = new_session(tiny_path)
    _step(session, 0)
    session.suspend(tmp_path / "idle", {})
    resumed, snapshots = ResidentModel.resume(tmp_path / "idle", tiny_path)
    assert snapshots == {}
    assert all(p.grad is None for p in trainable(resumed).values())


def test_a_saved_state_without_the_resident_parts_is_refused(
    tiny_path: Path, tmp_path: Path
) -> None:
    session = new_session(tiny_path)
    session.save_state(tmp_path / "state")  # a user's save: no gradients or snapshots
    with pytest.raises(PrimitiveError, match="not a resident model"):
        ResidentModel.resume(tmp_path / "state", tiny_path)
