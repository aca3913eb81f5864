"""Group-relative advantages and zero-variance groups, on hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.scoring.collect import zero_variance_groups
from trainer.update.advantages import AdvantageScale, group_advantages

TOL = 1e-6

# Three groups of G = 4. Row 2 has all-equal rewards.
REWARDS = torch.tensor(
    [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64
)


def test_group_scale_by_hand() -> None:
    # row 0: mean 0.5, population std sqrt(4 * 0.25 / 4) = 0.5 -> +-0.5 / 0.5 = +-1
    # row 1: mean 0.75, deviations (0.25, 0.25, 0.25, -0.75),
    #        std = sqrt((3 * 0.0625 + 0.5625) / 4) = sqrt(0.1875) = sqrt(3) / 4
    #        -> 0.25 / (sqrt(3) / 4) = 1 / sqrt(3), -0.75 / (sqrt(3) / 4) = -sqrt(3)
    # row 2: constant -> 0
    s3 = math.sqrt(3.0)
    expected = torch.tensor(
        [[1.0, -1.0, -1.0, 1.0], [1 / s3, 1 / s3, 1 / s3, -s3], [0.0, 0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    got = group_advantages(REWARDS, "group", eps=0.0)
    assert torch.allclose(got, expected, atol=TOL)
    # With the default eps the denominator is std + 1e-6: row 0 gives 0.5 / 0.500001.
    got_eps = group_advantages(REWARDS, "group")
    assert abs(float(got_eps[0, 0]) - 0.5 / 0.500001) < 1e-12


def test_batch_scale_by_hand() -> None:
    # All 12 rewards: sum 2 + 3 + 2 = 7, mean 7/12; sum of squares 2 + 3 + 4 * 0.25 = 6,
    # E[r^2] = 0.5; variance 0.5 - 49/144 = 23/144; population std sqrt(23) / 12.
    # Centred per group, divided by that std: row 0 +-0.5 * 12 / sqrt(23) = +-6 / sqrt(23);
    # row 1 0.25 * 12 / sqrt(23) = 3 / sqrt(23) and -0.75 * 12 / sqrt(23) = -9 / sqrt(23).
    s = math.sqrt(23.0)
    expected = torch.tensor(
        [[6 / s, -6 / s, -6 / s, 6 / s], [3 / s, 3 / s, 3 / s, -9 / s], [0.0, 0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    assert torch.allclose(group_advantages(REWARDS, "batch", eps=0.0), expected, atol=TOL)


def test_none_scale_is_centring_only() -> None:
    # Dr. GRPO: r - group mean. Row 0 mean 0.5, row 1 mean 0.75.
    expected = torch.tensor(
        [[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75], [0.0, 0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    assert torch.allclose(group_advantages(REWARDS, "none"), expected, atol=TOL)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_groups_give_exact_zero_not_nan(scale: AdvantageScale) -> None:
    # 0.1 is not representable: in float32 the mean of seven 0.1s differs from 0.1 by 7.5e-9,
    # and 7.5e-9 / (0 + eps) would not be 0. A single-completion group has std 0 as well.
    rounding = torch.full((2, 7), 0.1)
    assert (rounding - rounding.mean(dim=1, keepdim=True)).abs().max() > 0
    for rewards in (rounding, torch.tensor([[1.0], [0.0]])):
        for eps in (1e-6, 0.0):
            adv = group_advantages(rewards, scale, eps=eps)
            assert torch.equal(adv, torch.zeros_like(rewards))


def test_integer_rewards_are_accepted() -> None:
    adv = group_advantages(torch.tensor([[1, 0]]), "none")
    assert adv.is_floating_point()
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5]]))


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4), "group")
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 2), "per_token")  # type: ignore[arg-type]


def test_zero_variance_groups() -> None:
    rewards = torch.tensor(
        [[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.3, 0.3, 0.3 + 1e-8], [0.0, 0.0, 0.01]]
    )
    # row 2: population std about 4.7e-9 < 1e-6; row 3: std 0.0047 > 1e-6
    expected = torch.tensor([True, False, True, False])
    assert torch.equal(zero_variance_groups(rewards), expected)
    assert torch.equal(
        zero_variance_groups(rewards, tol=0.01), torch.tensor([True, False, True, True])
    )
