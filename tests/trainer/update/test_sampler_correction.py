"""Truncated importance sampling between the rollout engine and the trainer.

The central test enumerates every two-token completion of a tiny random Llama, with a bfloat16
copy as the "engine" and the float32 model as the trainer, and computes three expected policy
gradients exactly (no sampling noise): on-policy (samples of the trainer), uncorrected
(samples of the engine, as the loop sees them) and corrected (the same, weighted).
"""

from __future__ import annotations

import copy
from itertools import product
from typing import Any

import pytest
import torch
from torch import Tensor

from jobspec import GRPOSpec
from tests.trainer.conftest import tiny_llama
from trainer.update.batch import pack_batch
from trainer.update.logprobs import completion_logprobs
from trainer.update.policy_update import NonFiniteGuard, UpdateInputs, run_updates
from trainer.update.sampler_correction import correction_weights, mismatch_metrics

VOCAB = 24
PROMPT = [1, 2, 3]


def _all_completions() -> tuple[Tensor, Tensor]:
    """Every completion of two tokens after PROMPT: (input_ids [V^2, 5], attention). Token 0
    is the pad id, but attended to here it is an ordinary token, and the probabilities must
    sum to 1 over the whole vocabulary."""
    pairs = list(product(range(VOCAB), repeat=2))
    ids = torch.tensor([PROMPT + list(p) for p in pairs])
    return ids, torch.ones_like(ids)


def _logprobs(model: torch.nn.Module, ids: Tensor, att: Tensor) -> Tensor:
    lp, _ = completion_logprobs(model, ids, att, len(PROMPT))
    return lp.float()


def _expected_gradient(lp: Tensor, sample_p: Tensor, adv: Tensor, w: Tensor, model: Any) -> Tensor:
    """sum_y q(y) A(y) sum_t w_t(y) grad lp_t(y), flattened over the model's parameters."""
    objective = (sample_p[:, None] * adv[:, None] * w * lp).sum()
    grads = torch.autograd.grad(objective, list(model.parameters()), retain_graph=True)
    return torch.cat([g.reshape(-1) for g in grads])


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_corrected_gradient_is_closer_to_on_policy_than_uncorrected(mode: str) -> None:
    trainer_model = tiny_llama(VOCAB)
    engine_model = copy.deepcopy(trainer_model).to(torch.bfloat16)  # the mismatched sampler
    ids, att = _all_completions()
    lp = _logprobs(trainer_model, ids, att)  # [N, 2], with gradient
    with torch.no_grad():
        engine_lp = _logprobs(engine_model, ids, att)
    mask = torch.ones_like(lp)
    p_trainer = lp.detach().sum(-1).double().exp().float()
    p_engine = engine_lp.sum(-1).double().exp().float()
    assert abs(float(p_trainer.sum()) - 1) < 1e-4 and abs(float(p_engine.sum()) - 1) < 2e-2
    mismatch = (lp.detach() - engine_lp).abs().max()
    assert mismatch > 1e-3  # the two really differ
    # A sequence-level reward and its on-policy baseline.
    reward = (ids[:, 3] % 3 == 0).float() + 0.5 * (ids[:, 4] > ids[:, 3]).float()
    adv = reward - (p_trainer * reward).sum()

    ones = torch.ones_like(lp)
    on_policy = _expected_gradient(lp, p_trainer, adv, ones, trainer_model)
    uncorrected = _expected_gradient(lp, p_engine, adv, ones, trainer_model)
    w = correction_weights(lp, engine_lp, mask, mode, cap=10.0).weights  # type: ignore[arg-type]
    corrected = _expected_gradient(lp, p_engine, adv, w, trainer_model)

    err_uncorrected = float((uncorrected - on_policy).norm())
    err_corrected = float((corrected - on_policy).norm())
    assert err_uncorrected > 1e-4 * float(on_policy.norm())  # a real bias to remove
    assert err_corrected < 0.5 * err_uncorrected, (err_corrected, err_uncorrected)
    if mode == "sequence_truncate":
        # The completion's probability ratio makes it exactly on-policy (nothing is capped).
        assert err_corrected < 0.05 * err_uncorrected


def test_weights_by_hand() -> None:
    trainer = torch.tensor([[0.0, -1.0, -2.0], [-1.0, -1.0, 0.0]])
    sampler = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    e = torch.e
    token = correction_weights(trainer, sampler, mask, "token_truncate", cap=2.0)
    # ratios e, 1, 1/e (capped at 2 where e > 2); row 1: 1, e^0.5 = 1.65, padding 0
    expected = torch.tensor([[2.0, 1.0, 1 / e], [1.0, e**0.5, 0.0]])
    assert torch.allclose(token.weights, expected)
    assert token.capped.tolist() == [[True, False, False], [False, False, False]]
    masked = correction_weights(trainer, sampler, mask, "token_mask", cap=2.0)
    assert torch.allclose(masked.weights, torch.tensor([[0.0, 1.0, 1 / e], [1.0, e**0.5, 0.0]]))
    seq = correction_weights(trainer, sampler, mask, "sequence_truncate", cap=2.0)
    # row 0: e * 1 * 1/e = 1; row 1: e^0.5 = 1.65 (padding does not count)
    assert torch.allclose(seq.weights, torch.tensor([[1.0, 1.0, 1.0], [e**0.5, e**0.5, 0.0]]))
    seq_mask = correction_weights(trainer, sampler, mask, "sequence_mask", cap=1.5)
    assert torch.allclose(seq_mask.weights, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert seq_mask.capped.tolist() == [[False, False, False], [True, True, False]]
    none = correction_weights(trainer, sampler, mask, "none", cap=2.0)
    assert torch.equal(none.weights, mask.float())


def test_mismatch_metrics() -> None:
    trainer = torch.tensor([[0.0, -1.0], [-1.0, -1.0]])
    sampler = torch.tensor([[-1.0, -1.0], [-1.0, 9.0]])  # padding value must not count
    mask = torch.tensor([[1, 1], [1, 0]])
    m = mismatch_metrics(trainer, sampler, mask, "token_truncate", cap=2.0)
    e = torch.e
    assert m["mismatch/ratio_max"] == pytest.approx(e)
    assert m["mismatch/ratio_mean"] == pytest.approx((e + 1 + 1) / 3)
    assert m["mismatch/kl"] == pytest.approx((e - 1 - 1) / 3)  # k3 terms: e-1-1, 0, 0
    assert m["mismatch/capped_frac"] == pytest.approx(1 / 3)
    same = mismatch_metrics(trainer, trainer, mask, "token_truncate", cap=2.0)
    assert same["mismatch/kl"] == 0.0 and same["mismatch/ratio_max"] == 1.0
    assert same["mismatch/token_mult_prob_error"] == 1.0


def test_token_mult_prob_error_by_hand() -> None:
    """NeMo-RL's ``mean exp(|log pi_old - log pi_sampler|)`` over the valid tokens: a factor
    of f either way counts f, so a token 2x too likely and one 2x too unlikely do not cancel
    (their ratio_mean is 1.25, their error 2)."""
    trainer = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -3.0, -1.0]])
    sampler = torch.tensor([[-1.0, -1.0, -1.5], [0.0, -1.0, 5.0]])  # the padding's 5 never counts
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    m = mismatch_metrics(trainer, sampler, mask, "none", cap=2.0)
    # |log-ratios| of the five valid tokens: 1, 0, 0.5, 0.5, 2
    e = torch.e
    expected = (e + 1 + 2 * e**0.5 + e**2) / 5
    assert m["mismatch/token_mult_prob_error"] == pytest.approx(expected)
    assert m["mismatch/ratio_mean"] == pytest.approx((e + 1 + e**-0.5 + e**-0.5 + e**-2) / 5)
    half = torch.log(torch.tensor([[0.5, 0.25]]))
    both_ways = mismatch_metrics(half, half.flip(-1), torch.ones(1, 2), "none", cap=2.0)
    assert both_ways["mismatch/token_mult_prob_error"] == pytest.approx(2.0)
    assert both_ways["mismatch/ratio_mean"] == pytest.approx(1.25)
    # Clamped like the weights: a token off by e^50 counts e^20, finite.
    far = mismatch_metrics(
        torch.zeros(1, 1), torch.full((1, 1), -50.0), torch.ones(1, 1), "none", cap=2.0
    )
    assert far["mismatch/token_mult_prob_error"] == pytest.approx(e**20)


def _update_params(mode: str, engine_shift: float) -> list[Tensor]:
    model = tiny_llama(VOCAB)
    g = torch.Generator().manual_seed(4)
    comps = [torch.randint(1, VOCAB, (4,), generator=g).tolist() for _ in range(4)]
    with torch.no_grad():
        ids = torch.tensor([PROMPT + c for c in comps])
        trainer_lp = _logprobs(model, ids, torch.ones_like(ids))
    engine = [(row + engine_shift * torch.arange(4)).tolist() for row in trainer_lp]
    batch = pack_batch([PROMPT] * 4, comps, engine, [False] * 4, torch.ones(4), torch.device("cpu"))
    spec = GRPOSpec(learning_rate=0.1, sampler_correction={"mode": mode, "cap": 2.0})
    run_updates(
        UpdateInputs(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            batch=batch,
            advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
            step=1,
            seed=0,
            old_logprobs=None,
            ref_logprobs=None,
            pad_id=0,
            guard=NonFiniteGuard(lambda *a, **k: None),
            collect_pre_update=False,
        ),
        spec,
    )
    return [p.detach().clone() for p in model.parameters()]


def test_the_update_applies_the_weights_only_where_the_engine_differs() -> None:
    def same(a: list[Tensor], b: list[Tensor]) -> bool:
        return all(torch.allclose(x, y, atol=1e-7) for x, y in zip(a, b, strict=True))

    # The engine agrees with the trainer: every weight is 1, the correction changes nothing.
    assert same(_update_params("token_truncate", 0.0), _update_params("none", 0.0))
    # It does not: the corrected update differs from the uncorrected one.
    assert not same(_update_params("token_truncate", 0.3), _update_params("none", 0.3))
