"""What each loss-side KL estimator's gradient is on completions longer than one token.

A 2-token autoregressive toy, enumerated exactly: the first token is drawn from
``softmax(theta1)`` [K], the second from ``softmax(theta2[first])`` [K, K]; the reference has the
same shape. ``E[grad sum_t estimator_t]`` over all K^2 completions, weighted by their exact
probabilities, is compared with two targets:

- the per-position gradient, ``sum_t E_prefix[grad KL(pi_t || ref_t)]`` with the prefix's
  distribution held fixed (what a per-token estimator differentiates), and
- the gradient of the sequence KL, ``grad KL(pi || ref)`` over whole completions.

On one categorical the two coincide (tests/trainer/update/test_kl.py); here they do not, and only
k1_causal gives the second.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from trainer.update.kl import per_token_kl

K = 4


def _toy(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(theta1 [K], theta2 [K, K]) with gradient, (ref1 [K], ref2 [K, K]) log-probs."""
    g = torch.Generator().manual_seed(seed)

    def randn(scale: float, *shape: int) -> Tensor:
        return scale * torch.randn(*shape, generator=g, dtype=torch.float64)

    # Sharper second positions: their KL then differs a lot between first tokens, which is
    # what the per-position gradient leaves out.
    theta1 = randn(1.0, K).requires_grad_(True)
    theta2 = randn(3.0, K, K).requires_grad_(True)
    return theta1, theta2, randn(1.0, K).log_softmax(-1), randn(3.0, K, K).log_softmax(-1)


def _completions(
    theta1: Tensor, theta2: Tensor, ref1: Tensor, ref2: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Every completion (a, b): policy log-probs [K^2, 2] with gradient, reference log-probs
    [K^2, 2], and each completion's probability [K^2] (detached)."""
    pairs = list(itertools.product(range(K), repeat=2))
    first = torch.tensor([a for a, _ in pairs])
    second = torch.tensor([b for _, b in pairs])
    lp1, lp2 = theta1.log_softmax(-1), theta2.log_softmax(-1)
    lp = torch.stack([lp1[first], lp2[first, second]], dim=1)
    ref = torch.stack([ref1[first], ref2[first, second]], dim=1)
    return lp, ref, lp.sum(dim=1).exp().detach()


def _grad(value: Tensor, theta1: Tensor, theta2: Tensor) -> Tensor:
    g1, g2 = torch.autograd.grad(value, (theta1, theta2))
    return torch.cat([g1.flatten(), g2.flatten()])


def _expected_estimator_gradient(estimator: str, seed: int) -> Tensor:
    """``sum_y pi(y) grad sum_t estimator_t(y)``: the expectation of the gradient the loss
    term gets from ``per_token_kl`` (on-policy), before the aggregation's per-token weight."""
    theta1, theta2, ref1, ref2 = _toy(seed)
    lp, ref, probs = _completions(theta1, theta2, ref1, ref2)
    per_token = per_token_kl(estimator, lp, ref, mask=torch.ones_like(lp))  # type: ignore[arg-type]
    return _grad((probs * per_token.sum(dim=1)).sum(), theta1, theta2)


def _kl(p: Tensor, q: Tensor) -> Tensor:
    """KL between two categoricals given as log-probs along the last dim."""
    return (p.exp() * (p - q)).sum(dim=-1)


def _per_position_gradient(seed: int, *, reverse: bool) -> Tensor:
    """``grad [KL_1 + sum_a sg(pi1(a)) KL_2(a)]``: each position's KL differentiated with its
    prefix's probability held fixed (forward KL(pi || ref), or reverse KL(ref || pi))."""
    theta1, theta2, ref1, ref2 = _toy(seed)
    lp1, lp2 = theta1.log_softmax(-1), theta2.log_softmax(-1)
    kl1 = _kl(ref1, lp1) if reverse else _kl(lp1, ref1)
    kl2 = _kl(ref2, lp2) if reverse else _kl(lp2, ref2)
    return _grad(kl1 + (lp1.exp().detach() * kl2).sum(), theta1, theta2)


def _sequence_kl_gradient(seed: int) -> Tensor:
    """``grad KL(pi || ref)`` over whole 2-token completions."""
    theta1, theta2, ref1, ref2 = _toy(seed)
    lp, ref, _ = _completions(theta1, theta2, ref1, ref2)
    seq_lp = lp.sum(dim=1)
    return _grad((seq_lp.exp() * (seq_lp - ref.sum(dim=1))).sum(), theta1, theta2)


def _prefix_term(seed: int) -> Tensor:
    """``grad sum_a pi1(a) sg(KL_2(a))``: what moving the first token does to the KL the second
    position will have, the part of ``grad KL_seq`` a per-position gradient leaves out."""
    theta1, theta2, _, ref2 = _toy(seed)
    lp1, lp2 = theta1.log_softmax(-1), theta2.log_softmax(-1)
    return _grad((lp1.exp() * _kl(lp2, ref2).detach()).sum() + 0 * theta2.sum(), theta1, theta2)


def _relative_error(got: Tensor, target: Tensor) -> float:
    return float((got - target).norm() / target.norm())


SEEDS = [1, 2, 3]


@pytest.mark.parametrize("seed", SEEDS)
def test_k1_causal_is_the_gradient_of_the_sequence_kl(seed: int) -> None:
    got = _expected_estimator_gradient("k1_causal", seed)
    target = _sequence_kl_gradient(seed)
    assert target.norm() > 0.1
    assert torch.allclose(got, target, rtol=0, atol=1e-12), _relative_error(got, target)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("estimator", "reverse"), [("k2", False), ("k3_unbiased", False), ("k3", True)]
)
def test_per_token_estimators_give_the_per_position_gradient_not_the_sequence_one(
    estimator: str, reverse: bool, seed: int
) -> None:
    """k2 and k3_unbiased: exactly the per-position gradient of KL(pi || ref); k3: of
    KL(ref || pi). Neither is the sequence KL's gradient: far from it on this toy."""
    got = _expected_estimator_gradient(estimator, seed)
    per_position = _per_position_gradient(seed, reverse=reverse)
    assert torch.allclose(got, per_position, rtol=0, atol=1e-12)
    assert _relative_error(got, _sequence_kl_gradient(seed)) > 0.25


@pytest.mark.parametrize("seed", SEEDS)
def test_the_sequence_gradient_is_the_per_position_one_plus_the_prefix_term(seed: int) -> None:
    """What the per-position gradient misses is exactly the prefix term."""
    per_position = _per_position_gradient(seed, reverse=False)
    missing = _sequence_kl_gradient(seed) - per_position
    assert torch.allclose(missing, _prefix_term(seed), rtol=0, atol=1e-12)
    assert missing.norm() > 0.25 * per_position.norm()


@pytest.mark.parametrize("seed", SEEDS)
def test_k1_in_the_loss_has_no_expected_gradient(seed: int) -> None:
    got = _expected_estimator_gradient("k1", seed)
    assert torch.allclose(got, torch.zeros_like(got), rtol=0, atol=1e-12)


def test_k1_causal_reports_k1_and_ignores_positions_outside_the_mask() -> None:
    """Its value is k1 (the kl metric stays a KL estimate); the KL still to come sums only the
    completion's own tokens, so a padding slot's garbage log-prob changes no gradient."""
    lp = torch.tensor([[-1.0, -2.0, -30.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    value = per_token_kl("k1_causal", lp, ref, mask=mask)
    assert torch.equal(value[:, :2], (lp - ref).detach()[:, :2])
    (grad,) = torch.autograd.grad((value * mask).sum(), lp)
    # Position 0 carries the KL of both tokens (0.5 - 1.0), position 1 its own (-1.0).
    assert torch.allclose(grad, torch.tensor([[-0.5, -1.0, 0.0]], dtype=torch.float64))
