"""Every loss's gradient is exactly its objective's, through ``forward_backward`` itself.

For each loss, a float64 session on the tiny model takes three datums of different lengths
(5, 9 and 3 tokens; packed as [5, 9] and [3] by a small micro-batch budget, so padding and
accumulation over micro-batches are both on the path). The test computes the expected loss its
own way: each datum's log-probabilities from a plain full forward pass of the model (no
padding, full log-softmax, gather), and the loss formula written out below; the expected
gradient is ``torch.autograd.grad`` of that. ``forward_backward``'s accumulated gradient, its
``loss:sum`` and its log-probabilities must match to ~1e-10.

The data is built to reach every branch: targets that are not the next input token,
prompt-like positions with advantage 0 and q = 0 (as the cookbook sends them; only ``dro``'s
penalty reaches them), advantages of
both signs, negative and zero weights, ratios below and above the clip thresholds (checked),
per-token thresholds on one datum, and GSPO sequence ratios outside the clip range.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from tests.trainer.primitives.conftest import new_session, trainable
from trainer.primitives import LOSS_FUNCTIONS, Datum, ResidentModel
from trainer.primitives.losses import LOSSES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = (5, 9, 3)
PROMPT = 2  # leading positions of each datum with advantage 0 and q = 0
# q = lp + a per-datum offset + noise: GSPO's sequence ratio exp(mean(lp - q)) then lands
# above 1.2 (datum 0), below 0.8 (datum 1) and near 1 (datum 2).
OFFSETS = (-0.45, 0.45, 0.0)
TOL = 1e-10


def _session(tiny_path: Path) -> ResidentModel:
    # A 20-token budget packs datums 0 and 1 together (padded to 9) and datum 2 alone.
    return new_session(tiny_path, dtype=torch.float64, micro_batch_tokens=20)


def _reference_logprobs(session: ResidentModel, tokens: list[int], targets: list[int]) -> Tensor:
    """[N] log p(targets[t] | tokens[:t+1]) from a plain forward pass, with gradient."""
    logits = session.model(input_ids=torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(targets)[:, None])[:, 0]


def _build(session: ResidentModel, loss_fn: str, per_token_clips: bool) -> list[Datum]:
    generator = torch.Generator().manual_seed(7)
    vocab = session.vocab_size
    data = []
    for i, n in enumerate(LENGTHS):
        tokens = torch.randint(0, vocab, (n,), generator=generator).tolist()
        targets = torch.randint(0, vocab, (n,), generator=generator).tolist()
        with torch.no_grad():
            lp = _reference_logprobs(session, tokens, targets)
        noise = (torch.rand(n, generator=generator, dtype=torch.float64) - 0.5) * 0.8
        q = lp + OFFSETS[i] + noise
        adv = torch.randn(n, generator=generator, dtype=torch.float64)
        q[:PROMPT], adv[:PROMPT] = 0.0, 0.0
        inputs: dict[str, list[float] | list[int]] = {"target_tokens": targets}
        if loss_fn == "cross_entropy":
            weights = torch.randn(n, generator=generator, dtype=torch.float64)
            weights[0] = 0.0
            if i != 2:  # datum 2 leaves weights out: all ones
                inputs["weights"] = weights.tolist()
        else:
            inputs["logprobs"] = q.tolist()
            inputs["advantages"] = adv.tolist()
        if loss_fn == "gspo":
            mask = [0.0] * PROMPT + [1.0] * (n - PROMPT)
            if i == 1:
                mask[-1] = 0.0  # a token outside the sequence ratio that still trains
            inputs["sequence_ratio_mask"] = mask
        if per_token_clips and i == 1:
            inputs["clip_low_threshold"] = torch.linspace(0.7, 0.95, n).tolist()
            inputs["clip_high_threshold"] = torch.linspace(1.05, 1.3, n).tolist()
        data.append(Datum(tokens, inputs))
    return data


def _column(datum: Datum, key: str, default: float) -> Tensor:
    n = len(datum.tokens)
    value = datum.inputs.get(key)
    return (
        torch.tensor(value, dtype=torch.float64)
        if value is not None
        else torch.full((n,), default, dtype=torch.float64)
    )


def _clip_pair(datum: Datum, config: dict[str, float]) -> tuple[Tensor, Tensor]:
    low = _column(datum, "clip_low_threshold", config.get("clip_low_threshold", 0.8))
    high = _column(datum, "clip_high_threshold", config.get("clip_high_threshold", 1.2))
    return low, high


def _expected_datum_loss(
    loss_fn: str, lp: Tensor, datum: Datum, config: dict[str, float]
) -> Tensor:
    """The objective of one datum, written out from the protocol reference (§5)."""
    if loss_fn == "cross_entropy":
        return -(lp * _column(datum, "weights", 1.0)).sum()
    q = _column(datum, "logprobs", 0.0)
    adv = _column(datum, "advantages", 0.0)
    ratio = torch.exp(lp - q)
    low, high = _clip_pair(datum, config)
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    if loss_fn == "ppo":
        return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv).sum()
    if loss_fn == "cispo":
        return -(torch.clamp(ratio, low, high).detach() * lp * adv).sum()
    if loss_fn == "dro":
        beta = config.get("beta", 0.05)
        # Every token, A = 0 ones included (the prompt-like positions with q = 0 here).
        return -(lp * adv - 0.5 * beta * (lp - q) ** 2).sum()
    if loss_fn == "gspo":
        in_ratio = _column(datum, "sequence_ratio_mask", 0.0) != 0
        s = torch.exp((lp.detach() - q)[in_ratio].mean())
        token_ratio = s * torch.exp(lp - lp.detach())
        return -torch.minimum(token_ratio * adv, torch.clamp(token_ratio, low, high) * adv).sum()
    raise AssertionError(loss_fn)


CASES: list[tuple[str, dict[str, float], bool]] = [
    ("cross_entropy", {}, False),
    ("importance_sampling", {}, False),
    ("ppo", {}, False),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, True),
    ("cispo", {}, False),
    ("cispo", {"clip_low_threshold": 0.85}, True),
    ("dro", {}, False),
    ("dro", {"beta": 0.3}, False),
    ("gspo", {}, False),
    ("gspo", {"clip_high_threshold": 1.3}, True),
]


def test_the_cases_cover_every_registered_loss() -> None:
    assert {case[0] for case in CASES} == set(LOSS_FUNCTIONS)


@pytest.mark.parametrize(("loss_fn", "config", "per_token_clips"), CASES)
def test_gradient_is_the_objectives_exact_gradient(
    tiny_path: Path, loss_fn: str, config: dict[str, float], per_token_clips: bool
) -> None:
    session = _session(tiny_path)
    data = _build(session, loss_fn, per_token_clips)
    params = list(trainable(session).values())

    reference = [_reference_logprobs(session, d.tokens, d.inputs["target_tokens"]) for d in data]  # type: ignore[arg-type]
    expected_loss = sum(
        (
            _expected_datum_loss(loss_fn, lp, d, config)
            for lp, d in zip(reference, data, strict=True)
        ),
        torch.zeros((), dtype=torch.float64),
    )
    expected_grads = torch.autograd.grad(expected_loss, params)
    _check_the_data_reaches_the_clips(loss_fn, reference, data, config)

    result = session.forward_backward(data, loss_fn, config)

    assert result.metrics["loss:sum"] == pytest.approx(
        float(expected_loss.detach()), rel=1e-12, abs=1e-12
    )
    for got, want in zip(result.logprobs, reference, strict=True):
        assert torch.allclose(
            torch.tensor(got, dtype=torch.float64), want.detach(), rtol=0, atol=TOL
        )
    scale = max(float(g.abs().max()) for g in expected_grads)
    assert scale > 1e-3  # a gradient worth comparing
    for param, want in zip(params, expected_grads, strict=True):
        assert param.grad is not None
        assert float((param.grad - want).abs().max()) <= TOL * max(1.0, scale)


def _check_the_data_reaches_the_clips(
    loss_fn: str, reference: list[Tensor], data: list[Datum], config: dict[str, float]
) -> None:
    """The clipped losses' data must put tokens where each bound binds (a ratio above the
    high bound with A > 0, below the low one with A < 0), or a loss that ignored its clip
    would pass."""
    if loss_fn not in ("ppo", "cispo", "gspo"):
        return
    high_binds = low_binds = 0
    for lp, datum in zip(reference, data, strict=True):
        q, adv = _column(datum, "logprobs", 0.0), _column(datum, "advantages", 0.0)
        low, high = _clip_pair(datum, config)
        if loss_fn == "gspo":
            in_ratio = _column(datum, "sequence_ratio_mask", 0.0) != 0
            ratio = torch.exp((lp.detach() - q)[in_ratio].mean()).expand_as(lp)
        else:
            ratio = torch.exp(lp.detach() - q)
        high_binds += int(((ratio > high) & (adv > 0)).sum())
        low_binds += int(((ratio < low) & (adv < 0)).sum())
    assert high_binds > 0 and low_binds > 0


def test_a_token_with_zero_advantage_contributes_nothing_even_far_off_policy(
    tiny_path: Path,
) -> None:
    """Prompt positions carry A = 0 and q = 0: whatever their log-ratio (here far beyond the
    clamp), they add no loss, no gradient and no NaN."""
    session = _session(tiny_path)
    tokens = [5, 6, 7, 8]
    base = {"target_tokens": [9, 10, 11, 12], "advantages": [0.0, 0.0, 1.0, -1.0]}
    for loss_fn in ("importance_sampling", "ppo", "cispo"):
        near = session.forward_backward(
            [Datum(tokens, {**base, "logprobs": [0.0, 0.0, -3.0, -3.0]})],
            loss_fn,
            forward_only=True,
        )
        far = session.forward_backward(
            [Datum(tokens, {**base, "logprobs": [-500.0, 300.0, -3.0, -3.0]})], loss_fn
        )
        assert far.metrics["loss:sum"] == pytest.approx(near.metrics["loss:sum"], rel=1e-12)
        assert all(
            torch.isfinite(p.grad).all() for p in trainable(session).values() if p.grad is not None
        )
        session.optim_step(learning_rate=0.0)  # clears the gradients


def test_dro_on_made_up_numbers_is_its_penalty_where_the_advantage_is_zero() -> None:
    """Tinker's formula on every token: with A = 0 the loss is ``-Σ -β/2 (lp - q)^2`` and its
    gradient ``β (lp - q)``; the numbers are exact in binary (β = 0.5: diffs 0.5, -1, 0)."""
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    inputs = {
        "advantages": torch.zeros(1, 3, dtype=torch.float64),
        "logprobs": torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64),
    }
    per_token = LOSSES["dro"].objective(lp, inputs, {"beta": 0.5})
    assert per_token.tolist() == [[0.0625, 0.25, 0.0]]
    (grad,) = torch.autograd.grad(per_token.sum(), lp)
    assert grad.tolist() == [[0.25, -0.5, 0.0]]


def test_dro_on_flat_groups_is_the_penalty_alone_with_its_exact_gradient(
    tiny_path: Path,
) -> None:
    """A flat group (every advantage 0, q off the learner by up to ±0.6, padding and two
    micro-batches on the path): ``loss:sum`` is ``-Σ -β/2 (lp - q)^2`` over every real token
    and the accumulated gradient is that sum's, by enumeration against a plain forward."""
    session = _session(tiny_path)
    generator = torch.Generator().manual_seed(11)
    beta = 0.3
    data = []
    for n in LENGTHS:
        tokens = torch.randint(0, session.vocab_size, (n,), generator=generator).tolist()
        targets = torch.randint(0, session.vocab_size, (n,), generator=generator).tolist()
        with torch.no_grad():
            lp = _reference_logprobs(session, tokens, targets)
        q = lp + (torch.rand(n, generator=generator, dtype=torch.float64) - 0.5) * 1.2
        inputs = {"target_tokens": targets, "logprobs": q.tolist(), "advantages": [0.0] * n}
        data.append(Datum(tokens, inputs))
    params = list(trainable(session).values())
    expected = torch.zeros((), dtype=torch.float64)
    for d in data:
        lp = _reference_logprobs(session, d.tokens, d.inputs["target_tokens"])  # type: ignore[arg-type]
        q = torch.tensor(d.inputs["logprobs"], dtype=torch.float64)
        expected = expected - (-0.5 * beta * (lp - q) ** 2).sum()
    expected_grads = torch.autograd.grad(expected, params)

    result = session.forward_backward(data, "dro", {"beta": beta})

    assert float(expected.detach()) > 1e-3  # the penalty is there to see
    assert result.metrics["loss:sum"] == pytest.approx(
        float(expected.detach()), rel=1e-12, abs=1e-12
    )
    scale = max(float(g.abs().max()) for g in expected_grads)
    assert scale > 1e-4
    for param, want in zip(params, expected_grads, strict=True):
        assert param.grad is not None
        assert float((param.grad - want).abs().max()) <= TOL * max(1.0, scale)
