"""Clipped surrogate and loss aggregation on hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from jobspec import LossAggregation
from trainer.update.losses import (
    LOSS_AGGREGATIONS,
    aggregate,
    clipped_surrogate,
    masked_mean,
    valid_counts,
)

TOL = 1e-6
NAN = float("nan")


def _surrogate_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Ratios 0.5 (below 1 - 0.2), 1.0, 1.1 (inside), 1.5 (above 1 + 0.28); row 0 has A = +2,
    # row 1 A = -1, row 2 A = 0.
    ratios = torch.tensor([[0.5, 1.0, 1.1, 1.5]] * 3, dtype=torch.float64)
    old = torch.full((3, 4), -2.0, dtype=torch.float64)
    lp = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([2.0, -1.0, 0.0], dtype=torch.float64)
    return lp, old, adv


def test_clipped_surrogate_values_and_masks() -> None:
    lp, old, adv = _surrogate_case()
    out = clipped_surrogate(lp, old, adv, eps_low=0.2, eps_high=0.28)
    # A = +2: -min(r * 2, clip(r, 0.8, 1.28) * 2)
    #   r=0.5: min(1.0, 1.6) = 1.0 -> -1.0 (low clip does not bind for A > 0)
    #   r=1.0: -2.0;  r=1.1: -2.2
    #   r=1.5: min(3.0, 2.56) = 2.56 -> -2.56 (upper clip binds)
    # A = -1: -min(-r, -clip(r))
    #   r=0.5: min(-0.5, -0.8) = -0.8 -> 0.8 (lower clip binds)
    #   r=1.0: 1.0;  r=1.1: 1.1
    #   r=1.5: min(-1.5, -1.28) = -1.5 -> 1.5 (upper clip does not bind for A < 0)
    # A = 0: 0 everywhere, nothing clipped.
    expected = torch.tensor(
        [[-1.0, -2.0, -2.2, -2.56], [0.8, 1.0, 1.1, 1.5], [0.0, 0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    assert torch.allclose(out.per_token_loss, expected, atol=TOL)
    f, t = False, True
    assert torch.equal(out.clipped_low, torch.tensor([[f, f, f, f], [t, f, f, f], [f, f, f, f]]))
    assert torch.equal(out.clipped_high, torch.tensor([[f, f, f, t], [f, f, f, f], [f, f, f, f]]))
    assert torch.allclose(out.ratio, torch.tensor([[0.5, 1.0, 1.1, 1.5]] * 3, dtype=torch.float64))
    # d loss / d lp = -A * r where the unclipped term is selected, 0 where the clip binds.
    (grad,) = torch.autograd.grad(out.per_token_loss.sum(), lp)
    expected_grad = torch.tensor(
        [[-1.0, -2.0, -2.2, 0.0], [0.0, 1.0, 1.1, 1.5], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64
    )
    assert torch.allclose(grad, expected_grad, atol=TOL)


def test_clipped_surrogate_accepts_per_token_advantages() -> None:
    lp, old, adv = _surrogate_case()
    a = clipped_surrogate(lp, old, adv, 0.2, 0.28)
    b = clipped_surrogate(lp, old, adv[:, None].expand(3, 4), 0.2, 0.28)
    assert torch.equal(a.per_token_loss, b.per_token_loss)


def test_clipped_surrogate_is_finite_at_huge_log_ratios() -> None:
    lp = torch.tensor([[250.0, -250.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    for a in (1.0, -1.0):
        out = clipped_surrogate(lp, old, torch.tensor([a]), 0.2, 0.28)
        (grad,) = torch.autograd.grad(out.per_token_loss.sum(), lp)
        assert torch.isfinite(out.per_token_loss).all() and torch.isfinite(grad).all()


def test_a_clamped_token_whose_gradient_is_dropped_is_counted() -> None:
    """Beyond the +-20 log-ratio clamp the unclipped term is selected but has no gradient; no
    clip bound binds, so only ``clamped`` can tell. Inside the clamp nothing is counted."""
    lp = torch.tensor([[25.0, -25.0, 1.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    neg = clipped_surrogate(lp, old, torch.tensor([-1.0]), 0.2, 0.28)
    (grad,) = torch.autograd.grad(neg.per_token_loss.sum(), lp)
    assert grad[0, 0] == 0.0  # the dropped gradient...
    assert neg.clamped.tolist() == [[True, False, False]]  # ...is counted
    # No clip bound explains token 0 (token 1, ratio e^-25 with A < 0, is a lower-bound clip).
    assert neg.clipped_low.tolist() == [[False, True, False]] and not neg.clipped_high.any()
    pos = clipped_surrogate(lp, old, torch.tensor([1.0]), 0.2, 0.28)
    # A > 0, ratio e^-25: the unclipped term is selected, its gradient lost to the clamp; the
    # upper bound binds at e^25 (that gradient is zero by design, counted as clipped_high).
    assert pos.clamped.tolist() == [[False, True, False]]
    assert pos.clipped_high.tolist() == [[True, False, True]]


def test_dual_clip_caps_the_loss_of_negative_advantages() -> None:
    lp, old, adv = _surrogate_case()  # ratios 0.5, 1.0, 1.1, 1.5
    out = clipped_surrogate(lp, old, adv, 0.2, 0.28, clip_ratio_c=1.2)
    # A = -1: loss min(max(r, clip(r)), 1.2): 0.8, 1.0, 1.1, 1.2 (the cap binds at r = 1.5)
    assert torch.allclose(
        out.per_token_loss[1], torch.tensor([0.8, 1.0, 1.1, 1.2], dtype=torch.float64)
    )
    # A > 0 and A = 0 are untouched.
    plain = clipped_surrogate(lp, old, adv, 0.2, 0.28)
    assert torch.equal(out.per_token_loss[0], plain.per_token_loss[0])
    assert torch.equal(out.per_token_loss[2], plain.per_token_loss[2])
    f, t = False, True
    assert out.dual_clipped.tolist() == [[f, f, f, f], [f, f, f, t], [f, f, f, f]]
    (grad,) = torch.autograd.grad(out.per_token_loss.sum(), lp)
    assert grad[1, 3] == 0.0 and grad[1, 2] != 0.0
    # With the dual clip on, a ratio past the clamp with A < 0 is the cap's, not a silent drop.
    huge = clipped_surrogate(
        torch.tensor([[25.0]]), torch.zeros(1, 1), torch.tensor([-1.0]), 0.2, 0.28, clip_ratio_c=3
    )
    assert huge.dual_clipped.item() and not huge.clamped.item()
    assert huge.per_token_loss.item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        clipped_surrogate(lp, old, adv, 0.2, 0.28, clip_ratio_c=1.0)


# Three sequences with 3, 1 and 2 valid tokens, and a fourth with none; NaN at padding must not
# leak into any result.
VALUES = torch.tensor(
    [[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN], [5.0, 6.0, NAN, NAN], [NAN, NAN, NAN, NAN]],
    dtype=torch.float64,
)
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
# token_mean: (1 + 2 + 3 + 4 + 5 + 6) / 6 = 21 / 6 = 3.5
# seq_mean_token_mean: sequence means 6/3 = 2, 4/1 = 4, 11/2 = 5.5 -> (2 + 4 + 5.5) / 3 = 11.5 / 3
#   (the empty fourth sequence is not counted)
# seq_mean_token_sum_norm with max_completion_len 4: sums 6, 4, 11 -> 1.5, 1.0, 2.75 -> 5.25 / 3
EXPECTED: dict[LossAggregation, float] = {
    "token_mean": 3.5,
    "seq_mean_token_mean": 11.5 / 3,
    "seq_mean_token_sum_norm": 1.75,
}


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregate_by_hand(mode: LossAggregation) -> None:
    got = aggregate(VALUES, MASK, mode, max_completion_len=4)
    assert abs(float(got) - EXPECTED[mode]) < TOL


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregate_micro_batches_sum_to_full_batch(mode: LossAggregation) -> None:
    total_tokens, total_sequences = valid_counts(MASK)
    assert (total_tokens, total_sequences) == (6.0, 3.0)
    parts = [
        aggregate(
            VALUES[rows],
            MASK[rows],
            mode,
            max_completion_len=4,
            total_tokens=total_tokens,
            total_sequences=total_sequences,
        )
        for rows in (slice(0, 1), slice(1, 3), slice(3, 4))
    ]
    full = aggregate(VALUES, MASK, mode, max_completion_len=4)
    assert abs(float(sum(parts)) - float(full)) < 1e-12
    # Without the global counts the micro-batch results do not add up to the full value.
    local = [
        aggregate(VALUES[rows], MASK[rows], mode, max_completion_len=4)
        for rows in (slice(0, 1), slice(1, 3))
    ]
    assert abs(float(sum(local)) - float(full)) > 1e-3


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregate_empty_mask_is_zero_with_finite_gradient(mode: LossAggregation) -> None:
    values = torch.randn(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3)
    got = aggregate(values, mask, mode, max_completion_len=3)
    (grad,) = torch.autograd.grad(got, values)
    assert float(got.detach()) == 0.0 and torch.equal(grad, torch.zeros_like(grad))


def test_aggregate_gradient_weights() -> None:
    # token_mean weighs each valid token 1 / 6; seq_mean_token_mean weighs token t of sequence i
    # by 1 / (3 * |o_i|): 1/9 for the 3-token sequence, 1/3 for the 1-token one, 1/6 for the
    # 2-token one; Dr. GRPO weighs all valid tokens 1 / (3 * 4) = 1/12.
    values = torch.where(MASK.bool(), VALUES, 0.0).requires_grad_(True)
    weights: dict[LossAggregation, list[float]] = {
        "token_mean": [1 / 6, 1 / 6, 1 / 6],
        "seq_mean_token_mean": [1 / 9, 1 / 3, 1 / 6],
        "seq_mean_token_sum_norm": [1 / 12, 1 / 12, 1 / 12],
    }
    for mode, per_row in weights.items():
        loss = aggregate(values, MASK, mode, max_completion_len=4)
        (grad,) = torch.autograd.grad(loss, values)
        row_weights = torch.tensor([*per_row, 0.0], dtype=torch.float64)
        expected = MASK.to(torch.float64) * row_weights[:, None]
        assert torch.allclose(grad, expected, atol=1e-12), mode


def test_aggregate_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        aggregate(VALUES, MASK, "mean", max_completion_len=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        aggregate(VALUES, MASK, "seq_mean_token_sum_norm", max_completion_len=0)
    with pytest.raises(ValueError):
        aggregate(VALUES, MASK[:, :3], "token_mean", max_completion_len=4)


def test_masked_mean() -> None:
    # (1 + 2 + 3 + 4 + 5 + 6) / 6 = 3.5; per row: 2, 4, 5.5 and 0 for the empty row.
    assert abs(float(masked_mean(VALUES, MASK)) - 3.5) < TOL
    per_row = masked_mean(VALUES, MASK, dim=-1)
    assert torch.allclose(per_row, torch.tensor([2.0, 4.0, 5.5, 0.0], dtype=torch.float64))
    assert float(masked_mean(VALUES, torch.zeros_like(MASK))) == 0.0
    assert not math.isnan(float(masked_mean(VALUES, torch.zeros_like(MASK))))
