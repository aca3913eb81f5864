"""KL estimators: exact expected gradients, Schulman's table, and float32 robustness."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from jobspec import KLEstimatorName
from trainer.update.kl import KL_ESTIMATORS, kl_reward_penalty, per_token_kl

K = 5  # outcomes of the small categorical distributions
TOL = 1e-6


def _dists(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """theta (leaf logits of pi), log ref, log pi_old: three different distributions over K."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(K, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = torch.log_softmax(torch.randn(K, generator=g, dtype=torch.float64), dim=0)
    old = torch.log_softmax(torch.randn(K, generator=g, dtype=torch.float64), dim=0)
    return theta, ref, old


def _expected_grad(
    estimator: KLEstimatorName,
    theta: Tensor,
    ref: Tensor,
    sampling_logp: Tensor,
    old: Tensor | None,
) -> Tensor:
    """sum_x w(x) * grad k(x): the exact expectation of the estimator's gradient when tokens are
    drawn from exp(sampling_logp) (the weights are constants). The K outcomes are the T axis."""
    lp = torch.log_softmax(theta, dim=0).unsqueeze(0)  # [1, K]
    old_b = None if old is None else old.unsqueeze(0)
    kl = per_token_kl(estimator, lp, ref.unsqueeze(0), old_b)
    weights = sampling_logp.detach().exp().unsqueeze(0)
    (grad,) = torch.autograd.grad((weights * kl).sum(), theta)
    return grad


def _grad_kl_pi_ref(theta: Tensor, ref: Tensor) -> Tensor:
    """grad of the closed form KL(pi || ref) = sum pi (log pi - log ref)."""
    lp = torch.log_softmax(theta, dim=0)
    (grad,) = torch.autograd.grad((lp.exp() * (lp - ref)).sum(), theta)
    return grad


def _grad_kl_ref_pi(theta: Tensor, ref: Tensor) -> Tensor:
    """grad of the closed form KL(ref || pi) = sum ref (log ref - log pi)."""
    lp = torch.log_softmax(theta, dim=0)
    (grad,) = torch.autograd.grad((ref.exp() * (ref - lp)).sum(), theta)
    return grad


def _close(a: Tensor, b: Tensor) -> bool:
    return torch.allclose(a, b, rtol=0.0, atol=TOL)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k1_on_policy_expected_gradient_is_zero(seed: int) -> None:
    theta, ref, _ = _dists(seed)
    lp = torch.log_softmax(theta, dim=0)
    grad = _expected_grad("k1", theta, ref, lp, None)
    assert _close(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k2_on_policy_expected_gradient_is_grad_reverse_kl(seed: int) -> None:
    theta, ref, _ = _dists(seed)
    lp = torch.log_softmax(theta, dim=0)
    target = _grad_kl_pi_ref(theta, ref)
    assert target.abs().max() > 1e-2  # the comparison is not between two zeros
    assert _close(_expected_grad("k2", theta, ref, lp, None), target)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k3_on_policy_expected_gradient_is_grad_forward_kl(seed: int) -> None:
    theta, ref, _ = _dists(seed)
    lp = torch.log_softmax(theta, dim=0)
    target = _grad_kl_ref_pi(theta, ref)
    assert not _close(target, _grad_kl_pi_ref(theta, ref))  # the two KLs differ here
    assert _close(_expected_grad("k3", theta, ref, lp, None), target)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k3_unbiased_on_policy_expected_gradient_is_grad_reverse_kl(seed: int) -> None:
    theta, ref, _ = _dists(seed)
    lp = torch.log_softmax(theta, dim=0)
    grad = _expected_grad("k3_unbiased", theta, ref, lp, None)
    assert _close(grad, _grad_kl_pi_ref(theta, ref))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k3_unbiased_off_policy_expected_gradient_is_grad_reverse_kl(seed: int) -> None:
    theta, ref, old = _dists(seed)
    # Tokens are sampled from pi_old != pi and old_logprobs = log pi_old.
    grad = _expected_grad("k3_unbiased", theta, ref, old, old)
    assert _close(grad, _grad_kl_pi_ref(theta, ref))
    # Its expected value is KL(pi || ref) too.
    lp = torch.log_softmax(theta, dim=0).detach()
    value = (old.exp() * per_token_kl("k3_unbiased", lp[None], ref[None], old[None])[0]).sum()
    assert abs(float(value) - float((lp.exp() * (lp - ref)).sum())) < TOL


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k2_off_policy_is_biased(seed: int) -> None:
    theta, ref, old = _dists(seed)
    grad = _expected_grad("k2", theta, ref, old, old)
    assert (grad - _grad_kl_pi_ref(theta, ref)).abs().max() > 1e-2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k3_off_policy_without_ratio_is_biased(seed: int) -> None:
    # Why k3_unbiased exists: plain k3 sampled from pi_old is not grad KL(ref || pi) any more.
    theta, ref, old = _dists(seed)
    grad = _expected_grad("k3", theta, ref, old, old)
    assert (grad - _grad_kl_ref_pi(theta, ref)).abs().max() > 1e-2


# Schulman, "Approximating KL Divergence" (2020): q = N(0, 1) samples, p = N(mu, 1), r = p / q.
# In our notation the sampled policy is pi = q and the reference is p, so d = ref - lp = log r.
def _moments(estimator: KLEstimatorName, mu: float) -> tuple[float, float]:
    """E_q[k] and std_q[k] by trapezoidal quadrature on [-15, 15] (30,001 points, float64)."""
    x = torch.linspace(-15.0, 15.0, 30_001, dtype=torch.float64)
    dx = float(x[1] - x[0])
    log_q = -0.5 * x.square() - 0.5 * math.log(2 * math.pi)
    log_p = -0.5 * (x - mu).square() - 0.5 * math.log(2 * math.pi)
    w = log_q.exp() * dx
    w[0] *= 0.5
    w[-1] *= 0.5
    k = per_token_kl(estimator, log_q.unsqueeze(0), log_p.unsqueeze(0))[0]
    mean = float((w * k).sum())
    var = float((w * k.square()).sum()) - mean**2
    return mean, math.sqrt(var)


@pytest.mark.parametrize(
    ("mu", "k1_rel_std", "k2_rel_std", "k3_rel_std", "k3_digits"),
    [(0.1, 20.0, 1.42, 1.42, 2), (1.0, 2.0, 1.73, 1.7, 1)],
)
def test_schulman_table(
    mu: float, k1_rel_std: float, k2_rel_std: float, k3_rel_std: float, k3_digits: int
) -> None:
    true_kl = mu**2 / 2  # KL(q || p) for unit-variance Gaussians: 0.005 and 0.5
    m1, s1 = _moments("k1", mu)
    m2, s2 = _moments("k2", mu)
    m3, s3 = _moments("k3", mu)
    assert abs(m1 - true_kl) < TOL  # k1 unbiased
    assert abs(m3 - true_kl) < TOL  # k3 unbiased
    assert abs((m2 - true_kl) / true_kl - mu**2 / 4) < TOL  # k2 bias: 0.0025 and 0.25
    assert abs(s1 / true_kl - k1_rel_std) < TOL  # 2 / mu exactly
    assert round(s2 / true_kl, 2) == k2_rel_std
    assert round(s3 / true_kl, k3_digits) == k3_rel_std


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("ref_offset", [250.0, -250.0])
@pytest.mark.parametrize("old_offset", [None, 250.0, -250.0])
def test_finite_values_and_gradients_at_log_ratio_250(
    estimator: KLEstimatorName, ref_offset: float, old_offset: float | None
) -> None:
    lp = torch.full((2, 3), -1.0, dtype=torch.float32, requires_grad=True)
    ref = lp.detach() + ref_offset
    old = None if old_offset is None else lp.detach() + old_offset
    kl = per_token_kl(estimator, lp, ref, old)
    assert kl.dtype == torch.float32
    assert torch.isfinite(kl).all()
    if estimator == "none":
        assert not kl.requires_grad and (kl == 0).all()
        return
    (grad,) = torch.autograd.grad(kl.sum(), lp)
    assert torch.isfinite(grad).all()
    if estimator in ("k3", "k3_unbiased") and ref_offset > 0:
        # ref >> pi on this token: minimising the KL must raise lp. torch.clamp would have
        # zeroed the exp term's gradient and left +1 from the "-d" term (the wrong sign).
        assert (grad < 0).all()


def test_k3_is_clamped_before_exp() -> None:
    lp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[250.0, -250.0]])
    kl = per_token_kl("k3", lp, ref, max_log_ratio=20.0)
    # The value is k3 at the clamped log-ratio: exp(20) - 20 - 1 and exp(-20) + 20 - 1.
    expected = torch.tensor([[math.exp(20.0) - 21.0, math.exp(-20.0) + 19.0]])
    assert torch.allclose(kl.detach(), expected, rtol=1e-6)


def test_estimator_values_on_hand_example() -> None:
    # d = ref - lp = [-1, 0, 2]; old = lp + [0, log 2, 0] so r = exp(lp - old) = [1, 1/2, 1].
    lp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    ref = torch.tensor([[-2.0, -2.0, -1.0]], dtype=torch.float64)
    old = lp + torch.tensor([[0.0, math.log(2.0), 0.0]], dtype=torch.float64)
    e = math.e
    k3 = [math.exp(-1) + 1 - 1, 0.0, e**2 - 2 - 1]
    expected: dict[KLEstimatorName, list[float]] = {
        "k1": [1.0, 0.0, -2.0],
        "k2": [0.5, 0.0, 2.0],
        "k3": k3,
        "k3_unbiased": [k3[0] * 1.0, k3[1] * 0.5, k3[2] * 1.0],
        "none": [0.0, 0.0, 0.0],
    }
    for name, values in expected.items():
        got = per_token_kl(name, lp, ref, old)
        assert torch.allclose(got, torch.tensor([values], dtype=torch.float64), atol=TOL), name


def test_unknown_estimator_and_shape_mismatch_raise() -> None:
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError):
        per_token_kl("k4", lp, lp)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        per_token_kl("k2", lp, torch.zeros(2, 4))


def test_kl_reward_penalty_sums_valid_tokens_and_is_detached() -> None:
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, float("nan"), 7.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    pen = kl_reward_penalty(kl, mask, beta=0.5)
    # row 0: 0.5 * (0.1 + 0.2 + 0.3) = 0.3; row 1: 0.5 * 0.5 = 0.25 (NaN at padding ignored)
    assert torch.allclose(pen, torch.tensor([0.3, 0.25]), atol=TOL)
    assert not pen.requires_grad
