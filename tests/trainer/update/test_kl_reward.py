"""KL placed in the reward: for every estimator a job may name, the penalty's policy-gradient is
exactly grad KL(pi || ref), and through compute_advantages its expected update stays exactly
beta * grad KL under every advantage scaling, in flat groups too (enumeration of all K^G
groups)."""

from __future__ import annotations

import itertools
from typing import Any, get_args

import pytest
import torch
from torch import Tensor

from jobspec import AdvantageScale, GRPOSpec, JobSpec, KLEstimatorName
from trainer.update import kl as kl_math
from trainer.update.batch import Batch
from trainer.update.inputs import Scored, compute_advantages, reward_kl_penalty

K = 6  # outcomes of the small categorical: K one-token completions
BETA = 0.3
ESTIMATORS = [e for e in get_args(KLEstimatorName) if e != "none"]
SCALES = get_args(AdvantageScale)


def _dists(seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(K, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = torch.log_softmax(torch.randn(K, generator=g, dtype=torch.float64), dim=0)
    return theta, ref


def _batch(size: int) -> Batch:
    """``size`` one-token completions (only the mask matters to the penalty)."""
    ones = torch.ones(size, 1, dtype=torch.float64)
    return Batch(
        prompts=[[1]] * size,
        completions=[[i] for i in range(size)],
        mask=ones,
        loss_mask=ones,
        engine_logprobs=None,
        lengths=torch.ones(size),
        truncated=torch.zeros(size, dtype=torch.bool),
    )


def _spec(**kl: Any) -> GRPOSpec:
    return GRPOSpec(group_size=K, kl={"beta": BETA, "placement": "reward", **kl})


def _expected_penalty_gradient(estimator: str, theta: Tensor, ref: Tensor) -> Tensor:
    """sum_y pi(y) * penalty(y) * grad log pi(y): the exact expectation of the gradient the
    reward-side penalty contributes (with the sign of a cost), the penalty as the trainer
    computes it for a job naming ``estimator``."""
    lp = torch.log_softmax(theta, dim=0)
    scored = Scored(old=lp.detach().view(K, 1), old_entropy=None, ref=ref.view(K, 1))
    penalty = reward_kl_penalty(scored, _batch(K), _spec(estimator=estimator))
    assert penalty is not None and not penalty.requires_grad
    (grad,) = torch.autograd.grad((lp.exp().detach() * penalty * lp).sum(), theta)
    return grad


def _grad_kl_pi_ref(theta: Tensor, ref: Tensor) -> Tensor:
    lp = torch.log_softmax(theta, dim=0)
    (grad,) = torch.autograd.grad((lp.exp() * (lp - ref)).sum(), theta)
    return grad


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_the_reward_penalty_gradient_is_exactly_beta_grad_kl(estimator: str, seed: int) -> None:
    theta, ref = _dists(seed)
    target = BETA * _grad_kl_pi_ref(theta, ref)
    assert target.abs().max() > 1e-2  # not a comparison of two zeros
    got = _expected_penalty_gradient(estimator, theta, ref)
    assert torch.allclose(got, target, rtol=0, atol=1e-12), (estimator, got - target)


@pytest.mark.parametrize("estimator", ["k2", "k3", "k3_unbiased"])
def test_the_named_estimator_in_the_reward_would_be_biased(estimator: str) -> None:
    """Why the penalty ignores the estimator: its own per-token values there give a gradient
    off by a tenth or more of the true one (the review measured 0.17 to 0.20)."""
    theta, ref = _dists(0)
    lp = torch.log_softmax(theta, dim=0)
    per_token = kl_math.per_token_kl(estimator, lp.detach().view(K, 1), ref.view(K, 1))
    penalty = kl_math.kl_reward_penalty(per_token, torch.ones(K, 1), BETA)
    (grad,) = torch.autograd.grad((lp.exp().detach() * penalty * lp).sum(), theta)
    target = BETA * _grad_kl_pi_ref(theta, ref)
    assert (grad - target).abs().max() > 0.05 * BETA


def test_no_penalty_without_kl_in_the_reward() -> None:
    theta, ref = _dists(0)
    lp = torch.log_softmax(theta, dim=0).detach().view(K, 1)
    scored = Scored(old=lp, old_entropy=None, ref=ref.view(K, 1))
    loss_spec = GRPOSpec(group_size=K, kl={"beta": BETA, "placement": "loss"})
    assert reward_kl_penalty(scored, _batch(K), loss_spec) is None
    off = GRPOSpec(group_size=K, kl={"beta": 0.0, "placement": "reward"})
    assert reward_kl_penalty(scored, _batch(K), off) is None


def _expected_update(
    theta: Tensor, ref: Tensor, task: Tensor, spec: GRPOSpec, outcomes: int
) -> Tensor:
    """``E[(1/G) sum_i A_i grad log pi(y_i)]`` over every one of the ``outcomes^G`` groups a
    categorical policy ``softmax(theta)`` [outcomes] can draw, each weighted by its exact
    probability; ``A`` from ``compute_advantages`` with the penalty ``reward_kl_penalty``
    computes, for a step whose batch is that one group. ``task`` [outcomes] is each outcome's
    reward. float64 throughout."""
    g = spec.group_size
    probs = torch.softmax(theta.detach(), dim=0)
    lp = torch.log_softmax(theta.detach(), dim=0)
    score = torch.eye(outcomes, dtype=torch.float64) - probs  # [outcomes, outcomes]: grad log pi
    total = torch.zeros(outcomes, dtype=torch.float64)
    for ys in itertools.product(range(outcomes), repeat=g):
        y = torch.tensor(ys)
        scored = Scored(old=lp[y].view(g, 1), old_entropy=None, ref=ref[y].view(g, 1))
        penalty = reward_kl_penalty(scored, _batch(g), spec)
        adv = compute_advantages(task[y], penalty, spec)
        total += probs[y].prod() * (adv.unsqueeze(1) * score[y]).sum(dim=0) / g
    return total


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("group_size", [2, 3, 4])
@pytest.mark.parametrize("scale", SCALES)
def test_the_kl_part_of_the_expected_update_is_exactly_beta_grad_kl(
    scale: str, group_size: int, seed: int
) -> None:
    """Whatever the scaling: the expected update with the penalty minus the one without it is
    ``-beta * grad KL(pi || ref)``, exactly (c = 1: the baseline leaves each sample out). The
    task rewards make many groups flat (all 0 or all 1), where the penalty must act too. On
    the code before this fix the KL part was 0.16x to 12x of that, pointing elsewhere."""
    outcomes = 3
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(outcomes, generator=g, dtype=torch.float64)
    ref = torch.log_softmax(torch.randn(outcomes, generator=g, dtype=torch.float64), dim=0)
    task = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    kl = {"beta": BETA, "placement": "reward", "estimator": "k1"}
    spec = GRPOSpec(group_size=group_size, advantage_scale=scale, kl=kl)
    no_kl = GRPOSpec(group_size=group_size, advantage_scale=scale, kl={**kl, "beta": 0.0})
    kl_part = _expected_update(theta, ref, task, spec, outcomes) - _expected_update(
        theta, ref, task, no_kl, outcomes
    )
    target = -BETA * _grad_kl_pi_ref(theta.clone().requires_grad_(True), ref)
    assert target.abs().max() > 1e-2  # not a comparison of two zeros
    assert torch.allclose(kl_part, target, rtol=0, atol=1e-12), (kl_part, target)


@pytest.mark.parametrize("scale", SCALES)
def test_a_flat_group_gets_the_penalty_at_its_own_size(scale: str) -> None:
    """A group whose task rewards are all equal: the advantages are minus the centred
    penalty, hundredths of a nat as the penalty is, not blown up by any std and not dropped."""
    shaped = torch.tensor([1.0] * K + [0.0, 1.0] * (K // 2))  # group 0 flat, group 1 not
    penalty = torch.linspace(0.01, 0.03, 2 * K)  # tiny KL differences
    spec = GRPOSpec(group_size=K, advantage_scale=scale, kl={"beta": BETA, "placement": "reward"})
    adv = compute_advantages(shaped, penalty, spec)
    flat = penalty[:K]
    expected = -(flat - (flat.sum() - flat) / (K - 1))
    assert torch.allclose(adv[:K], expected, rtol=0, atol=1e-7)
    assert 0 < adv[:K].abs().max() < 0.05
    no_kl = compute_advantages(shaped, None, spec)
    # The task's part is the scaled task advantage, as without KL.
    assert torch.allclose(
        adv[K:] - no_kl[K:], -(penalty[K:] - (penalty[K:].sum() - penalty[K:]) / (K - 1)), atol=1e-6
    )


def test_validation_warns_when_the_named_estimator_is_not_the_reward_penalty() -> None:
    base: dict[str, Any] = {
        "model": "tiny-random-llama",
        "dataset": {"rows": [{"prompt": "p", "answer": "a"}]},
        "graders": [{"type": "exact_match"}],
    }
    spec = JobSpec.model_validate(
        {**base, "grpo": {"kl": {"estimator": "k3_unbiased", "beta": 0.1, "placement": "reward"}}}
    )
    assert any("penalises with k1" in w for w in spec.warnings())
    k1 = JobSpec.model_validate(
        {**base, "grpo": {"kl": {"estimator": "k1", "beta": 0.1, "placement": "reward"}}}
    )
    assert k1.warnings() == []
    flat = JobSpec.model_validate(
        {**base, "grpo": {"kl": {"beta": 0.1, "placement": "reward", "estimator": "k1",
                                 "flat_groups": "keep"}}}
    )  # fmt: skip
    assert any("flat_groups is ignored" in w for w in flat.warnings())
    # Off-policy bias is a loss-side matter: in the reward the penalty is k1 whatever is named.
    for placement, warned in (("loss", True), ("reward", False)):
        kl = {"estimator": "k1_causal", "beta": 0.1, "placement": placement}
        spec = JobSpec.model_validate({**base, "grpo": {"num_iterations": 2, "kl": kl}})
        assert any("biased off-policy" in w for w in spec.warnings()) == warned
