"""The KL part of the expected GRPO update, exactly, through the step's own code path, under
every loss aggregation, for completions of different lengths.

A tabular autoregressive policy over {A, B, EOS} (the next token's logits are a row of a table
picked by the current token) samples completions of at most 2 tokens: EOS, A EOS, A A, A B,
B EOS, B A, B B, the last four cut by the token limit. For every group of G completions, weighted
by its exact probability, one step runs as the loop runs it: ``collect_groups`` (with dynamic
sampling's keep rule), ``kl_only_groups``, ``rank_batch``, ``shaped_rewards``,
``score_logprobs``, ``reward_kl_penalty``, ``split_advantages`` and ``run_updates`` (the
surrogate, the aggregation, the KL estimator, the backward pass and an SGD step with rate 1,
whose move is the gradient). The expected update with the KL minus the one without it is the
KL's part; it must be ``beta / max_new_tokens`` times the gradient the estimator names
(docs/trainer.md): ``grad KL_seq`` for the reward-side penalty and ``k1_causal``, the
per-position gradient of KL(pi || ref) for ``k2`` and ``k3_unbiased``, of KL(ref || pi) for
``k3``. float64 throughout.

Before the KL terms had a normaliser of their own, the same enumeration on the same path, with
the best-fitting constant instead of ``beta / max_new_tokens``, left relative residuals of 7-30%
under ``token_mean`` (the default) and 18-132% under ``seq_mean_token_mean``, and only
``seq_mean_token_sum_norm`` was exact; dynamic sampling, which trained the KL on the kept groups
only, was off by more than the gradient itself (90-180%).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_args

import pytest
import torch
from torch import Tensor, nn

from jobspec import GRPOSpec, LossAggregation
from trainer.data.dataset import Example, PromptSampler
from trainer.distributed.world import World
from trainer.models.reference import Reference
from trainer.rollout.base import Completion
from trainer.run.rank_batch import rank_batch
from trainer.scoring.collect import Group, collect_groups
from trainer.scoring.rewards import RewardFunction
from trainer.update.batch import Batch
from trainer.update.inputs import (
    kl_only_groups,
    needs_old_logprobs,
    reward_kl_penalty,
    score_logprobs,
    shaped_rewards,
    split_advantages,
)
from trainer.update.policy_update import NonFiniteGuard, UpdateInputs, run_updates

A, B, EOS, PROMPT = 0, 1, 2, 3
VOCAB = 4  # the prompt token is never sampled (its logit is -inf)
MAX_NEW = 2
BETA = 0.5
OUTCOMES: list[tuple[int, ...]] = [
    (EOS,),
    *((first, EOS) for first in (A, B)),
    *((first, second) for first in (A, B) for second in (A, B)),
]
AGGREGATIONS = get_args(LossAggregation)
NEVER = torch.tensor([0.0, 0.0, 0.0, -torch.inf], dtype=torch.float64)  # the prompt token's logit


@dataclass
class _Hidden:
    last_hidden_state: Tensor


class _OneHot(nn.Module):
    """The toy's decoder: each position's hidden state is the one-hot of its token."""

    def forward(self, input_ids: Tensor, **_: Any) -> _Hidden:
        return _Hidden(nn.functional.one_hot(input_ids, VOCAB).to(torch.float64))


class _Table(nn.Module):
    """The output head: the next token's logits are the current token's row of ``weight``."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())

    def forward(self, hidden: Tensor) -> Tensor:
        return hidden @ self.weight + NEVER


class _Policy(nn.Module):
    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.decoder = _OneHot()
        self.head = _Table(weight)

    def get_decoder(self) -> nn.Module:
        return self.decoder

    def get_output_embeddings(self) -> nn.Module:
        return self.head


class _Scripted:
    """A rollout engine that returns the completions it is given, whatever it is asked."""

    def __init__(self, outcomes: Sequence[tuple[int, ...]]) -> None:
        self.outcomes = outcomes

    def generate(self, prompts: list[list[int]], n: int, **_: Any) -> list[list[Completion]]:
        assert len(prompts) == 1 and n == len(self.outcomes)
        return [[_completion(o) for o in self.outcomes]]


def _completion(outcome: tuple[int, ...]) -> Completion:
    finish = "stop" if outcome[-1] == EOS else "length"
    text = "".join("AB"[t] for t in outcome if t != EOS)
    return Completion(list(outcome), None, text, finish)  # type: ignore[arg-type]


def _reward(texts: list[str], items: list[Mapping[str, Any]]) -> list[float]:
    """1 for a completion that says A first: many groups come out flat (all 0 or all 1)."""
    return [1.0 if t.startswith("A") else 0.0 for t in texts]


def _tables(seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    policy = torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64)
    ref = 2.0 * torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64)
    return policy, ref


def _spec(aggregation: str, kl: dict[str, Any], group: int, dynamic: bool) -> GRPOSpec:
    return GRPOSpec(
        group_size=group,
        prompts_per_step=1,
        max_new_tokens=MAX_NEW,
        loss_aggregation=aggregation,
        kl=kl,
        dynamic_sampling={"enabled": dynamic, "max_rounds": 1},
        max_grad_norm=1e6,
        micro_batch_size=2,  # several micro-batches: their global counts are part of the path
    )


def _step_gradient(
    policy: Tensor, ref: Tensor, outcomes: tuple[tuple[int, ...], ...], spec: GRPOSpec
) -> Tensor:
    """The gradient one step applies for a group of ``outcomes``, through the loop's phases."""
    reference = Reference(_Policy(ref), shares_policy=False) if spec.kl.active else None
    return step_update(_Policy(policy), reference, _Scripted(outcomes), _reward, spec)


def step_update(
    model: _Policy,
    reference: Reference | None,
    engine: object,
    reward: Callable[[list[str], list[Mapping[str, Any]]], list[float]],
    spec: GRPOSpec,
    on_batch: Callable[[Batch, list[Group]], None] | None = None,
) -> Tensor:
    """One step of the loop's phases (``collect_groups`` to ``run_updates``, SGD at rate 1) on
    ``engine``'s completions of the one prompt: the change of ``model``'s head table [P, V].
    ``on_batch(batch, groups)`` sees the packed batch before it is scored
    (tests/trainer/update/test_async_exact.py restores its float64 engine log-probs)."""
    device = torch.device("cpu")
    col = collect_groups(
        engine,  # type: ignore[arg-type]
        RewardFunction(reward),
        PromptSampler(1, seed=0),
        [[PROMPT]],
        [Example("p", None)],
        spec,
        seed=0,
        step=1,
        should_stop=lambda: False,
    )
    kl_only = kl_only_groups(col, spec)
    if not (col.kept or kl_only):
        return torch.zeros_like(model.head.weight)
    rb = rank_batch(col.kept, spec, device, World(), 1, kl_only)
    if on_batch is not None:
        on_batch(rb.batch, [*rb.kept, *kl_only])
    shaped = shaped_rewards(rb.kept, rb.whole, spec)
    with_old = needs_old_logprobs(spec, rb.whole.size)
    scored = score_logprobs(model, reference, rb.batch, spec, pad_id=EOS, with_old=with_old)
    penalty = reward_kl_penalty(scored, rb.batch, spec)
    adv = split_advantages(shaped, penalty, spec, rows=rb.whole.size)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model.head.weight.detach().clone()
    run_updates(
        UpdateInputs(
            model=model,
            optimizer=optimizer,
            batch=rb.batch,
            advantages=adv.total,
            kl_advantages=adv.kl,
            old_logprobs=scored.old,
            ref_logprobs=scored.ref,
            pad_id=EOS,
            guard=NonFiniteGuard(lambda *a, **k: None),
            step=1,
            seed=0,
        ),
        spec,
    )
    return before - model.head.weight.detach()


def _outcome_logprob(table: Tensor, outcome: tuple[int, ...]) -> Tensor:
    """``log pi(outcome)`` under the table ``table`` [VOCAB, VOCAB]: a scalar."""
    logp = torch.log_softmax(table + NEVER, -1)
    prev = (PROMPT, *outcome[:-1])
    return torch.stack([logp[p, t] for p, t in zip(prev, outcome, strict=True)]).sum()


def _expected_update(policy: Tensor, ref: Tensor, spec: GRPOSpec) -> Tensor:
    total = torch.zeros_like(policy)
    for outcomes in itertools.product(OUTCOMES, repeat=spec.group_size):
        prob = torch.stack([_outcome_logprob(policy, o) for o in outcomes]).sum().exp()
        total += prob * _step_gradient(policy, ref, outcomes, spec)
    return total


def _kl_seq_gradient(policy: Tensor, ref: Tensor) -> Tensor:
    """``grad KL(pi || ref)`` over whole completions."""
    theta = policy.clone().requires_grad_(True)
    kl = torch.stack(
        [
            _outcome_logprob(theta, o).exp()
            * (_outcome_logprob(theta, o) - _outcome_logprob(ref, o))
            for o in OUTCOMES
        ]
    ).sum()
    (grad,) = torch.autograd.grad(kl, theta)
    return grad


def _per_position_gradient(policy: Tensor, ref: Tensor, *, reverse: bool) -> Tensor:
    """``grad sum_t E_prefix[KL_t]`` with each prefix's probability held fixed (KL(pi || ref),
    or KL(ref || pi) when ``reverse``)."""
    theta = policy.clone().requires_grad_(True)
    lp = torch.log_softmax(theta + NEVER, -1)[:, :3]
    lr = torch.log_softmax(ref + NEVER, -1)[:, :3]

    def kl(row: int) -> Tensor:
        p, q = (lr[row], lp[row]) if reverse else (lp[row], lr[row])
        return (p.exp() * (p - q)).sum()

    first = lp[PROMPT].exp().detach()
    total = kl(PROMPT) + first[A] * kl(A) + first[B] * kl(B)
    (grad,) = torch.autograd.grad(total, theta)
    return grad


NAMED = {
    "reward": lambda p, r: _kl_seq_gradient(p, r),
    "k1_causal": lambda p, r: _kl_seq_gradient(p, r),
    "k2": lambda p, r: _per_position_gradient(p, r, reverse=False),
    "k3_unbiased": lambda p, r: _per_position_gradient(p, r, reverse=False),
    "k3": lambda p, r: _per_position_gradient(p, r, reverse=True),
}


def _kl_spec(kind: str, beta: float) -> dict[str, Any]:
    if kind == "reward":
        return {"beta": beta, "placement": "reward", "estimator": "k1"}
    return {"beta": beta, "placement": "loss", "estimator": kind}


def _relative_residual(kind: str, aggregation: str, group: int, dynamic: bool, seed: int) -> float:
    policy, ref = _tables(seed)
    with_kl = _spec(aggregation, _kl_spec(kind, BETA), group, dynamic)
    without = _spec(aggregation, _kl_spec(kind, 0.0), group, dynamic)
    kl_part = _expected_update(policy, ref, with_kl) - _expected_update(policy, ref, without)
    target = BETA / MAX_NEW * NAMED[kind](policy, ref)
    assert target.abs().max() > 1e-2  # not a comparison of two zeros
    return float((kl_part - target).norm() / target.norm())


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", list(NAMED))
def test_the_kl_part_of_the_step_is_exactly_the_named_gradient(kind: str, aggregation: str) -> None:
    """Every aggregation, both placements, groups of 2 of completions of 1 and 2 tokens."""
    assert _relative_residual(kind, aggregation, group=2, dynamic=False, seed=0) < 1e-12


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", ["reward", "k3_unbiased"])
def test_the_kl_stays_exact_when_dynamic_sampling_drops_flat_groups(
    kind: str, aggregation: str
) -> None:
    """Dynamic sampling trains the task on the groups whose rewards differ; the KL acts on
    every group it sampled, so its expected pull is the one without dynamic sampling."""
    assert _relative_residual(kind, aggregation, group=2, dynamic=True, seed=1) < 1e-12


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_groups_of_three_with_a_second_draw(aggregation: str) -> None:
    assert _relative_residual("reward", aggregation, group=3, dynamic=False, seed=2) < 1e-12
