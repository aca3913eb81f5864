"""The per-token loss mask of completions that hold injected tokens (an agent episode's tool
results): those tokens get exactly zero gradient and count in no loss denominator; without a
mask (or an all-ones one) the batch and the update are bit-identical to before."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor

from jobspec import GRPOSpec
from tests.trainer.conftest import tiny_llama
from trainer.update import policy_update
from trainer.update.batch import Batch, pack_batch
from trainer.update.policy_update import NonFiniteGuard, UpdateInputs, run_updates

CPU = torch.device("cpu")
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
COMPLETIONS = [[14, 15, 16, 17, 18, 19, 20], [21, 22, 23], [24, 25, 26, 27, 28]]
# Row 0: a sampled turn, an injected tool result, a sampled answer; row 1: no injection;
# row 2: a sampled turn followed only by injected tokens and one sampled token.
TOKEN_MASKS = [[1, 1, 0, 0, 0, 1, 1], [1, 1, 1], [1, 0, 0, 0, 1]]
# Dyadic advantages: on-policy every per-token loss is exactly -A (ratio exp(0) = 1), so any
# summation order gives the same float and the reference below can be compared exactly.
ADVANTAGES = torch.tensor([1.0, -0.5, 0.25])


def batch(token_masks: Any = None, logprobs: Any = None) -> Batch:
    lps = logprobs if logprobs is not None else [[-0.5] * len(c) for c in COMPLETIONS]
    return pack_batch(
        PROMPTS,
        COMPLETIONS,
        lps,
        [False] * 3,
        torch.ones(3),
        CPU,
        token_masks=token_masks,
    )


@contextmanager
def capture_logprobs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Tensor]]:
    """The update's own log-probs of the sampled tokens ([b, t], with gradient), kept with
    their .grad after backward."""
    seen: list[Tensor] = []
    original = policy_update.completion_logprobs

    def keep(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        lp, ent = original(*args, **kwargs)
        lp.retain_grad()
        seen.append(lp)
        return lp, ent

    monkeypatch.setattr(policy_update, "completion_logprobs", keep)
    yield seen


def update(b: Batch, spec: GRPOSpec) -> tuple[float, list[Tensor]]:
    """One on-policy update of the whole batch (SGD, one micro-batch): (loss, new params)."""
    model = tiny_llama(40)
    stats, _ = run_updates(
        UpdateInputs(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            batch=b,
            advantages=ADVANTAGES,
            old_logprobs=None,
            ref_logprobs=None,
            pad_id=0,
            guard=NonFiniteGuard(lambda *a, **k: None),
            step=1,
            seed=0,
        ),
        spec,
    )
    return stats.policy_loss, [p.detach().clone() for p in model.parameters()]


def test_no_mask_and_an_all_ones_mask_are_bit_identical() -> None:
    plain = batch()
    ones = batch([[1] * len(c) for c in COMPLETIONS])
    listed = batch([None, None, None])
    for other in (ones, listed):
        for name in ("mask", "loss_mask", "engine_logprobs", "lengths", "truncated"):
            assert torch.equal(getattr(plain, name), getattr(other, name)), name
    spec = GRPOSpec(micro_batch_size=3)
    loss, params = update(plain, spec)
    loss_ones, params_ones = update(ones, spec)
    assert loss == loss_ones
    assert all(torch.equal(a, b) for a, b in zip(params, params_ones, strict=True))


def test_the_mask_reaches_every_mask_of_the_batch() -> None:
    b = batch(TOKEN_MASKS)
    expected = torch.zeros(3, 7)
    for i, m in enumerate(TOKEN_MASKS):
        expected[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    assert torch.equal(b.mask, expected) and torch.equal(b.loss_mask, expected)
    assert b.lengths.tolist() == [7.0, 3.0, 5.0]  # every token of a completion, injected too
    with pytest.raises(ValueError, match="row 1"):
        batch([[1] * 7, [1, 1], [1] * 5])


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
def test_injected_tokens_get_exactly_zero_gradient_and_no_share_of_the_loss(
    monkeypatch: pytest.MonkeyPatch, aggregation: str
) -> None:
    spec = GRPOSpec(micro_batch_size=3, loss_aggregation=aggregation, max_new_tokens=16)
    mask = batch(TOKEN_MASKS).mask.bool()  # [3, 7]
    unsort = torch.argsort(torch.tensor([1, 2, 0]))  # the micro-batch is in length order
    # With the sampler correction on, the engine's logprob at an injected position is garbage
    # (NaN): it must reach neither the loss nor a gradient.
    garbage = [[float("nan") if not m else -0.5 for m in masks] for masks in TOKEN_MASKS]
    with capture_logprobs(monkeypatch) as seen:
        loss, params = update(batch(TOKEN_MASKS, garbage), spec)
    assert torch.isfinite(torch.tensor(loss)) and all(bool(p.isfinite().all()) for p in params)
    grad = seen[0].grad[unsort]  # type: ignore[index]
    assert torch.equal(grad[~mask], torch.zeros(int((~mask).sum())))

    # Without it (the per-token loss is then exactly -A on-policy), the values themselves.
    exact = GRPOSpec.model_validate({**spec.model_dump(), "sampler_correction": {"mode": "none"}})
    monkeypatch.undo()
    with capture_logprobs(monkeypatch) as seen:
        loss, _ = update(batch(TOKEN_MASKS), exact)
    (lp,) = seen
    assert lp.grad is not None
    grad = lp.grad[unsort]
    # Masked (injected) positions: exactly zero, not small. (A position's logits reach the
    # loss only through its own log-prob, so their gradient is zero too.)
    assert torch.equal(grad[~mask], torch.zeros(int((~mask).sum())))
    assert bool((grad[mask] != 0).all())
    # The loss is the loss of the sampled tokens alone, counted without the injected ones.
    sampled = [sum(m) for m in TOKEN_MASKS]  # [4, 3, 2]
    per_row = [-float(a) * n for a, n in zip(ADVANTAGES, sampled, strict=True)]  # token sums
    if aggregation == "token_mean":
        ref = torch.tensor(sum(per_row)) / torch.tensor(float(sum(sampled)))
    elif aggregation == "seq_mean_token_mean":
        ref = (
            sum(
                torch.tensor(s) / torch.tensor(float(n))
                for s, n in zip(per_row, sampled, strict=True)
            )
            / 3
        )
    else:
        ref = sum(torch.tensor(s) / 16.0 for s in per_row) / 3
    assert loss == float(ref)
    # And each sampled token's gradient is what that loss gives it: -A_i / denominator.
    for i, n in enumerate(sampled):
        denominator = {
            "token_mean": float(sum(sampled)),
            "seq_mean_token_mean": 3.0 * n,
            "seq_mean_token_sum_norm": 3.0 * 16,
        }[aggregation]
        expected = torch.full((n,), -float(ADVANTAGES[i])) / denominator
        assert torch.allclose(grad[i][mask[i]], expected, rtol=1e-6, atol=0)
