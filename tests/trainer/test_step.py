from __future__ import annotations

import math

import pytest
import torch

from trainer.config import GRPOSpec
from trainer.errors import NonFiniteLossError
from trainer.step import NonFiniteGuard, derive_seed, lr_factor, make_scheduler, pack_batch


def test_lr_schedules() -> None:
    const = GRPOSpec(steps=10, warmup_steps=2)
    assert [lr_factor(const, k) for k in (1, 2, 3, 10)] == [0.5, 1.0, 1.0, 1.0]
    linear = GRPOSpec(steps=6, warmup_steps=2, lr_schedule="linear")
    assert [lr_factor(linear, k) for k in range(1, 7)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    )
    cosine = GRPOSpec(steps=5, lr_schedule="cosine")
    values = [lr_factor(cosine, k) for k in range(1, 6)]
    assert values[0] == 1.0 and values == sorted(values, reverse=True) and values[-1] > 0
    assert values[2] == pytest.approx(0.5 * (1 + math.cos(math.pi * 2 / 5)))


def test_scheduler_steps_once_per_training_step() -> None:
    spec = GRPOSpec(steps=4, warmup_steps=2, learning_rate=0.1, lr_schedule="linear")
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=spec.learning_rate)
    sched = make_scheduler(opt, spec)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradients: changes nothing
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.05])


def test_derive_seed_is_stable_and_distinct() -> None:
    assert derive_seed(0, 1, 0) == derive_seed(0, 1, 0)
    seeds = {derive_seed(s, step, r) for s in (0, 1) for step in range(50) for r in range(3)}
    assert len(seeds) == 300 and all(0 <= x < 2**31 for x in seeds)


def test_pack_batch_masks() -> None:
    batch = pack_batch(
        [[1, 2], [3]],
        [[5, 6, 7], [8]],
        [[-0.1, -0.2, -0.3], [-0.4]],
        [True, False],
        torch.tensor([0.0, 1.0]),  # the first (truncated) completion is out of the loss
        torch.device("cpu"),
    )
    assert batch.mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 0], [1, 0, 0]]
    assert batch.lengths.tolist() == [3, 1]
    assert batch.engine_logprobs is not None
    assert batch.engine_logprobs[0].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    missing = pack_batch([[1]], [[5]], [None], [False], torch.ones(1), torch.device("cpu"))
    assert missing.engine_logprobs is None


def test_non_finite_guard_counts_consecutive() -> None:
    events: list[str] = []
    guard = NonFiniteGuard(lambda kind, *a, **k: events.append(kind), limit=3)
    assert not guard.check(1, float("nan"), 1.0)
    assert not guard.check(2, 1.0, float("inf"))
    assert guard.check(3, 1.0, 1.0) and guard.streak == 0  # a good update resets the streak
    assert not guard.check(4, float("nan"), 1.0)
    assert not guard.check(5, float("nan"), 1.0)
    with pytest.raises(NonFiniteLossError) as info:
        guard.check(6, float("nan"), 1.0)
    assert info.value.reason == "non_finite_loss"
    assert events == ["non_finite"] * 5 and guard.skipped == 5
