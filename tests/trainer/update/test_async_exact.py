"""Asynchronous GRPO's update on stale samples, exactly, through the step's own code path.

With ``grpo.async.max_staleness: K`` step t trains on completions that an older policy version
sampled (pi_b, version ``max(0, t - 1 - K)``). The trainer scores pi_old with its current
weights (the ratio pi_theta / pi_old is 1 at the first minibatch) and the sampler correction
weights each token's policy loss by pi_old / pi_b, pi_b being the engine's log-probs
(``Completion.logprobs``). Is the expected update then the on-policy one?

The toy is test_kl_exact's tabular policy over {A, B, EOS}, here with completions of 1 to 3
tokens (15 outcomes; groups of 3 with 1 to 2 tokens). For every group of G completions,
weighted by its exact probability under the policy that SAMPLED it, one step runs as the loop
runs it: ``collect_groups`` (a scripted engine that reports the sampler's log-probs),
``rank_batch``, ``shaped_rewards``, ``score_logprobs``, ``reward_kl_penalty``,
``split_advantages`` and ``run_updates`` (correction weights, surrogate, aggregation, KL, the
backward pass over several micro-batches and an SGD step of rate 1, whose move is the
gradient). The stale expectation (groups under pi_b, engine log-probs log pi_b) is compared
with the on-policy one (groups under pi_theta, engine log-probs log pi_theta). float64.

Exact (1e-10): ``advantage_scale: none``, a sequence-level correction (``sequence_truncate`` or
``sequence_mask``) whose cap is above every enumerated weight W = pi_theta(y) / pi_b(y), and
``seq_mean_token_sum_norm``. A group's update is then ``(1 / (G L)) sum_i W_i A_i grad log
pi(y_i)`` with ``A_i = r_i - mean_j r_j``: ``E_b[W_i f(y_i)] = E_pi[f(y_i)]`` for any f, and the
baseline's cross terms ``E_b[W_i r_j grad log pi(y_i)] = E_pi[grad log pi] E_b[r_j]`` vanish
under either distribution. Every other setting breaks a link: a token's weight corrects its
token, not its prefix (``token_*``); a cap that binds leaves ``min(W, C) != W``; no correction
leaves pi_b's distribution; the group std makes ``A_i`` a nonlinear function of the group, so
the cross terms no longer factor; ``token_mean`` and ``seq_mean_token_mean`` weigh each
completion's ``grad log pi`` by a length factor (``1 / |o_i|``, or one over the batch's tokens)
whose mean under pi is not 0, so the cross terms stay and carry pi_b's mean reward.

The KL: the reward-side penalty (k1, in the advantages, so weighted by the correction) is
exactly ``beta / max_new_tokens * grad KL(pi || ref)`` with the sequence correction, under
every aggregation. The loss-side term is NOT weighted: its expected gradient is
``grad E_b[sum_t k_t]``, the estimator averaged over pi_b's completions (for k1:
``-grad KL(pi_b || pi_theta)``, a push away from the sampler), for no estimator the on-policy
one (docs/trainer.md, "Async GRPO: what staleness changes in the gradient").
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from jobspec import GRPOSpec
from tests.trainer.update.test_kl_exact import EOS, PROMPT, VOCAB, A, B, _Policy, step_update
from trainer.models.reference import Reference
from trainer.rollout.base import Completion, FinishReason
from trainer.scoring.collect import Group
from trainer.update import kl as kl_math
from trainer.update.batch import Batch

Outcome = tuple[int, ...]
BETA = 0.5
STALENESS = 0.5  # pi_b's table is pi_theta's plus this times a standard normal draw
HIGH_CAP = 100.0  # above every enumerated sequence weight (checked)
BINDING_CAP = 1.1  # below two of them (checked)


def _outcomes(max_new: int) -> list[Outcome]:
    """Every completion of at most ``max_new`` tokens: ending in EOS, or cut at the limit."""
    ended = [(*p, EOS) for n in range(max_new) for p in itertools.product((A, B), repeat=n)]
    return ended + list(itertools.product((A, B), repeat=max_new))


def _reward(texts: list[str], items: list[Mapping[str, Any]]) -> list[float]:
    """Multiples of 3 that differ between completions: a group's float32 mean (of 2 or 3) and
    each centred reward are exact, so ``advantage_scale: none`` leaves no rounding behind."""
    return [3.0 * (t.count("A") + 2 * t.startswith("B") - len(t) // 3) for t in texts]


class _Engine:
    """Returns the completions it is given with the sampler's log-probs of their tokens."""

    def __init__(self, outcomes: Sequence[Outcome], sampler: Tensor) -> None:
        self.outcomes = outcomes
        self.logp = sampler

    def generate(self, prompts: list[list[int]], n: int, **_: Any) -> list[list[Completion]]:
        assert len(prompts) == 1 and n == len(self.outcomes)
        return [[self._completion(o) for o in self.outcomes]]

    def _completion(self, outcome: Outcome) -> Completion:
        lps = [float(self.logp[p, t]) for p, t in _positions(outcome)]
        finish: FinishReason = "stop" if outcome[-1] == EOS else "length"
        text = "".join("AB"[t] for t in outcome if t != EOS)
        return Completion(list(outcome), lps, text, finish)


def _positions(outcome: Outcome) -> list[tuple[int, int]]:
    """(the token before, the token) at each position of ``outcome``."""
    return list(zip((PROMPT, *outcome[:-1]), outcome, strict=True))


def _log_table(table: Tensor) -> Tensor:
    """[VOCAB, VOCAB] next-token log-probabilities of a table (the prompt token never comes;
    one ``log_softmax`` per table: with the -inf logit it is slow on CPU)."""
    never = torch.tensor([0.0, 0.0, 0.0, -torch.inf], dtype=torch.float64)
    return torch.log_softmax(table + never, -1)


def _logprob(logp: Tensor, outcome: Outcome) -> Tensor:
    """``log pi(outcome)`` from a :func:`_log_table`: a scalar."""
    return torch.stack([logp[p, t] for p, t in _positions(outcome)]).sum()


def _tables(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """(pi_theta's table, the stale pi_b's, the reference's), [VOCAB, VOCAB] each."""
    g = torch.Generator().manual_seed(seed)
    current = torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64)
    stale = current + STALENESS * torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64)
    ref = 2.0 * torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64)
    return current, stale, ref


def _spec(
    *,
    mode: str = "sequence_truncate",
    cap: float = HIGH_CAP,
    scale: str = "none",
    aggregation: str = "seq_mean_token_sum_norm",
    kl: dict[str, Any] | None = None,
    group: int = 2,
    max_new: int = 3,
) -> GRPOSpec:
    return GRPOSpec(
        group_size=group,
        prompts_per_step=1,
        max_new_tokens=max_new,
        loss_aggregation=aggregation,
        advantage_scale=scale,
        sampler_correction={"mode": mode, "cap": cap},
        kl=kl or {},
        max_grad_norm=1e6,
        micro_batch_size=2,  # several micro-batches: their global counts are part of the path
    )


def _engine_logprobs_in_float64(batch: Batch, groups: Sequence[Group]) -> None:
    """``pack_batch`` stores the engine's log-probs in float32 (a real engine's are float32
    values, so nothing is lost there); the toy's are float64, and an exact comparison needs
    them whole. Checked to be exactly what was packed, rounded, then put back unrounded."""
    exact = torch.zeros(batch.size, batch.width, dtype=torch.float64)
    for row, comp in enumerate(c for g in groups for c in g.completions):
        assert comp.logprobs is not None
        exact[row, : len(comp.logprobs)] = torch.tensor(comp.logprobs, dtype=torch.float64)
    assert batch.engine_logprobs is not None
    assert torch.equal(batch.engine_logprobs, exact.float())
    batch.engine_logprobs = exact


def _step_gradient(
    current: Tensor, sampler: Tensor, ref: Tensor, outcomes: Sequence[Outcome], spec: GRPOSpec
) -> Tensor:
    """The gradient one step applies for a group of ``outcomes`` sampled by the policy of
    the :func:`_log_table` ``sampler``; ``current`` and ``ref`` are tables."""
    reference = Reference(_Policy(ref), shares_policy=False) if spec.kl.active else None
    engine = _Engine(outcomes, sampler)
    return step_update(
        _Policy(current), reference, engine, _reward, spec, on_batch=_engine_logprobs_in_float64
    )


_EXPECTATIONS: dict[str, Tensor] = {}


def _expected_update(seed: int, *, stale: bool, **settings: Any) -> Tensor:
    """``E[update]`` of a step under ``_spec(**settings)``, over every group, each weighted by
    its probability under the policy that sampled it: pi_b (``stale``, the engine's log-probs
    pi_b's) or pi_theta (on-policy: the engine's log-probs pi_theta's, no correction, which
    would weigh every token 1). Cached: the on-policy expectations serve several settings."""
    if not stale:
        settings = {**settings, "mode": "none", "cap": HIGH_CAP}
    key = repr((seed, stale, sorted(settings.items())))
    if key not in _EXPECTATIONS:
        current, behaviour, ref = _tables(seed)
        sampler = _log_table(behaviour if stale else current)
        spec = _spec(**settings)
        outcomes = _outcomes(spec.max_new_tokens)
        probs = {o: _logprob(sampler, o).exp() for o in outcomes}
        total = torch.zeros_like(current)
        for group in itertools.product(outcomes, repeat=spec.group_size):
            prob = torch.stack([probs[o] for o in group]).prod()
            total += prob * _step_gradient(current, sampler, ref, group, spec)
        _EXPECTATIONS[key] = total
    return _EXPECTATIONS[key]


def _relative(value: Tensor, target: Tensor) -> float:
    assert target.abs().max() > 1e-2  # not a comparison of two zeros
    return float((value - target).norm() / target.norm())


def _staleness_residual(seed: int = 0, **settings: Any) -> float:
    """|E_b[corrected update] - E_pi[update]| / |E_pi[update]|."""
    stale = _expected_update(seed, stale=True, **settings)
    return _relative(stale, _expected_update(seed, stale=False, **settings))


def _sequence_weights(seed: int, max_new: int) -> Tensor:
    """``W = pi_theta(y) / pi_b(y)`` of every enumerated completion."""
    current, behaviour, _ = (_log_table(t) for t in _tables(seed))
    return torch.stack(
        [(_logprob(current, o) - _logprob(behaviour, o)).exp() for o in _outcomes(max_new)]
    )


# --- the task's update -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_sequence_corrected_stale_update_is_exactly_the_on_policy_one(mode: str) -> None:
    """Completions of 1 to 3 tokens, groups of 2: every cap far above every weight."""
    weights = _sequence_weights(0, 3)
    assert weights.max() < HIGH_CAP and (weights - 1).abs().max() > 0.3  # stale, never capped
    assert _staleness_residual(mode=mode) < 1e-10


def test_sequence_corrected_stale_update_is_exact_in_groups_of_three() -> None:
    weights = _sequence_weights(1, 2)
    assert weights.max() < HIGH_CAP and (weights - 1).abs().max() > 0.3
    assert _staleness_residual(group=3, max_new=2, seed=1) < 1e-10


# Measured with seed 0 (STALENESS 0.5, W in [0.27, 1.52]): the residual of each setting.
BIASED: dict[str, tuple[dict[str, Any], float]] = {
    "token_mean": ({"aggregation": "token_mean"}, 0.036),
    "seq_mean_token_mean": ({"aggregation": "seq_mean_token_mean"}, 0.095),
    "token_truncate": ({"mode": "token_truncate"}, 0.056),
    "token_mask": ({"mode": "token_mask"}, 0.056),
    "group_std": ({"scale": "group"}, 0.106),
    "binding_cap_truncate": ({"cap": BINDING_CAP}, 0.026),
    "binding_cap_mask": ({"mode": "sequence_mask", "cap": BINDING_CAP}, 0.100),
    "no_correction": ({"mode": "none"}, 0.557),
}


@pytest.mark.parametrize("name", list(BIASED))
def test_every_other_setting_leaves_a_residual(name: str) -> None:
    """The same enumeration fails where the argument of the module's docstring breaks."""
    settings, measured = BIASED[name]
    if "cap" in settings:
        assert (_sequence_weights(0, 3) > BINDING_CAP).any()
    residual = _staleness_residual(**settings)
    assert residual > 1e-3
    assert residual == pytest.approx(measured, rel=0.02)  # the figures docs/trainer.md gives


# --- the KL term ---------------------------------------------------------------------------

KL_NEW = 2  # completions of 1 and 2 tokens, groups of 2, for the KL's enumerations
ESTIMATORS = ["k1", "k2", "k3", "k3_unbiased", "k1_causal"]
REWARD_KL = {"beta": BETA, "placement": "reward", "estimator": "k1"}


def _kl_part(stale: bool, kl: dict[str, Any], **settings: Any) -> Tensor:
    """The expected update with the KL term minus the one without it."""
    with_kl = _expected_update(0, stale=stale, kl=kl, max_new=KL_NEW, **settings)
    return with_kl - _expected_update(0, stale=stale, max_new=KL_NEW, **settings)


def _kl_seq_gradient() -> Tensor:
    """``grad KL(pi_theta || pi_ref)`` over whole completions."""
    current, _, ref = _tables(0)
    theta = current.clone().requires_grad_(True)
    lp, lr = _log_table(theta), _log_table(ref)
    kl = torch.stack(
        [_logprob(lp, o).exp() * (_logprob(lp, o) - _logprob(lr, o)) for o in _outcomes(KL_NEW)]
    ).sum()
    (grad,) = torch.autograd.grad(kl, theta)
    return grad


def _sampler_average_gradient(estimator: str) -> Tensor:
    """``grad E_b[sum_t k_t]``: the estimator's per-token values of pi_theta (their gradients
    as ``kl.per_token_kl`` gives them, ``old`` = pi_theta's), averaged over pi_b's completions."""
    current, behaviour, ref = _tables(0)
    theta = current.clone().requires_grad_(True)
    lp_table, lr, lb = _log_table(theta), _log_table(ref), _log_table(behaviour)
    total = theta.new_zeros(())
    for o in _outcomes(KL_NEW):
        lp = torch.stack([lp_table[p, t] for p, t in _positions(o)])[None]
        ref_lp = torch.stack([lr[p, t] for p, t in _positions(o)])[None]
        name: Any = estimator
        per_token = kl_math.per_token_kl(name, lp, ref_lp, mask=torch.ones_like(lp))
        total = total + _logprob(lb, o).exp() * per_token.sum()
    (grad,) = torch.autograd.grad(total, theta)
    return grad


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
def test_reward_side_kl_of_stale_samples_is_exactly_grad_kl_seq(aggregation: str) -> None:
    """The penalty is in the advantages, so the sequence correction weighs it too: its part of
    the update is ``beta / max_new_tokens * grad KL(pi_theta || ref)``, as on-policy."""
    kl_part = _kl_part(True, REWARD_KL, aggregation=aggregation)
    assert _relative(kl_part, BETA / KL_NEW * _kl_seq_gradient()) < 1e-10


@pytest.mark.parametrize(("mode", "measured"), [("token_truncate", 0.482), ("none", 0.915)])
def test_reward_side_kl_without_the_sequence_correction_is_not(mode: str, measured: float) -> None:
    kl_part = _kl_part(True, REWARD_KL, mode=mode)
    residual = _relative(kl_part, BETA / KL_NEW * _kl_seq_gradient())
    assert residual > 1e-3
    assert residual == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_loss_side_kl_of_stale_samples_is_the_estimator_averaged_over_the_sampler(
    estimator: str,
) -> None:
    """The loss-side KL is not weighted by the correction: its part of the update is
    ``beta / max_new_tokens * grad E_b[sum_t k_t]``, exactly, whatever the correction."""
    kl = {"beta": BETA, "placement": "loss", "estimator": estimator}
    target = BETA / KL_NEW * _sampler_average_gradient(estimator)
    for mode in ("sequence_truncate", "none"):
        assert _relative(_kl_part(True, kl, mode=mode), target) < 1e-10


def test_loss_side_k1_of_stale_samples_pushes_away_from_the_sampler() -> None:
    """k1's loss-side part is ``-beta / L * grad KL(pi_b || pi_theta)`` (0 on-policy): a
    descent step raises the KL from the policy that sampled, whatever the reference."""
    current, behaviour, _ = _tables(0)
    theta = current.clone().requires_grad_(True)
    lp, lb = _log_table(theta), _log_table(behaviour)
    kl_b = torch.stack(
        [_logprob(lb, o).exp() * (_logprob(lb, o) - _logprob(lp, o)) for o in _outcomes(KL_NEW)]
    ).sum()
    (grad,) = torch.autograd.grad(kl_b, theta)
    kl = {"beta": BETA, "placement": "loss", "estimator": "k1"}
    assert _relative(_kl_part(True, kl), -BETA / KL_NEW * grad) < 1e-10
    assert _kl_part(False, kl).abs().max() < 1e-12


@pytest.mark.parametrize(
    ("estimator", "measured"),
    [("k2", 0.870), ("k3", 1.461), ("k3_unbiased", 0.870), ("k1_causal", 0.570)],
)
def test_loss_side_kl_of_stale_samples_is_not_the_on_policy_one(
    estimator: str, measured: float
) -> None:
    """Each estimator's stale part against its on-policy part (the gradient docs/trainer.md's
    table names, tests/trainer/update/test_kl_exact.py)."""
    kl = {"beta": BETA, "placement": "loss", "estimator": estimator}
    residual = _relative(_kl_part(True, kl), _kl_part(False, kl))
    assert residual > 1e-2
    assert residual == pytest.approx(measured, rel=0.02)
