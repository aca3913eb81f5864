"""Overlong reward shaping (DAPO eq. 13) and truncated-completion masking."""

from __future__ import annotations

import pytest
import torch

from trainer.update.shaping import overlong_penalty, truncation_loss_mask

TOL = 1e-6


def test_overlong_penalty_dapo_eq13() -> None:
    # max_len 20, cache_len 4 -> the window starts at 20 - 4 = 16.
    #   10, 16 -> 0 (at or below the window start)
    #   17 -> (16 - 17) / 4 = -0.25;  18 -> -0.5;  19 -> -0.75
    #   20 -> (16 - 20) / 4 = -1 (reaches -1 at max_len);  25 -> -1 (beyond max_len)
    lengths = torch.tensor([10, 16, 17, 18, 19, 20, 25])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0])
    got = overlong_penalty(lengths, max_len=20, cache_len=4)
    assert got.dtype == torch.float32
    assert torch.allclose(got, expected, atol=TOL)
    # penalty scales every piece: 0.5 * the above
    half = overlong_penalty(lengths, max_len=20, cache_len=4, penalty=0.5)
    assert torch.allclose(half, 0.5 * expected, atol=TOL)


def test_overlong_penalty_whole_range_cache() -> None:
    # cache_len == max_len: linear from length 0. 3 -> -3/8 = -0.375; 8 -> -1.
    got = overlong_penalty(torch.tensor([0, 3, 8]), max_len=8, cache_len=8)
    assert torch.allclose(got, torch.tensor([0.0, -0.375, -1.0]), atol=TOL)


def test_overlong_penalty_rejects_bad_window() -> None:
    for cache_len in (0, -1, 21):
        with pytest.raises(ValueError):
            overlong_penalty(torch.tensor([1]), max_len=20, cache_len=cache_len)
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([[1]]), max_len=20, cache_len=4)


def test_truncation_loss_mask() -> None:
    truncated = torch.tensor([False, True, False, True])
    assert torch.equal(truncation_loss_mask(truncated, enabled=True), torch.tensor([1.0, 0, 1, 0]))
    assert torch.equal(truncation_loss_mask(truncated, enabled=False), torch.ones(4))
