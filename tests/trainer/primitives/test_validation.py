"""Hostile ``forward_backward`` calls: each is a PrimitiveError naming the field, raised
before anything is computed (no gradient appears)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.primitives.conftest import grads, new_session
from trainer.primitives import LOSS_FUNCTIONS, Datum, PrimitiveError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 57  # the tiny model's


def _is(n: int = 8, **changes: Any) -> Datum:
    """An importance_sampling datum of n tokens, with ``changes`` to its inputs (None
    removes one)."""
    inputs: dict[str, Any] = {
        "target_tokens": list(range(1, n + 1)),
        "logprobs": [-1.0] * n,
        "advantages": [0.5] * n,
    }
    for key, value in changes.items():
        if value is None:
            inputs.pop(key)
        else:
            inputs[key] = value
    return Datum(list(range(n)), inputs)


NAN, INF = math.nan, math.inf

# (data, loss_fn, config, text the message must contain)
CASES: list[tuple[list[Datum], str, dict[str, Any] | None, str]] = [
    ([_is()], "nonsense", None, "loss_fn: unknown loss 'nonsense'"),
    (
        [_is()],
        "stable_reinforce",
        None,
        "loss_fn: 'stable_reinforce' is not supported by this server",
    ),
    ([_is()], "custom", None, "loss_fn: 'custom' is not supported by this server"),
    ([], "importance_sampling", None, "data: no datums"),
    (
        [_is(), _is(advantages=[0.5] * 7)],
        "importance_sampling",
        None,
        "data[1].loss_fn_inputs.advantages: 7 values for 8 tokens",
    ),
    (
        [_is(target_tokens=[1] * 9)],
        "importance_sampling",
        None,
        "data[0].loss_fn_inputs.target_tokens: 9 values for 8 tokens",
    ),
    (
        [Datum([1, 2, VOCAB], {"target_tokens": [1, 2, 3]})],
        "cross_entropy",
        None,
        f"data[0].model_input[2]: token id {VOCAB} is outside the vocabulary",
    ),
    (
        [Datum([1, -1], {"target_tokens": [1, 2]})],
        "cross_entropy",
        None,
        "data[0].model_input[1]: token id -1",
    ),
    (
        [Datum([1, 2], {"target_tokens": [1, VOCAB]})],
        "cross_entropy",
        None,
        "data[0].loss_fn_inputs.target_tokens[1]: token id 57",
    ),
    (
        [Datum([1, 2], {"target_tokens": [1.0, 2.5]})],
        "cross_entropy",
        None,
        "data[0].loss_fn_inputs.target_tokens: expected a list of integer token ids",
    ),
    ([Datum([], {"target_tokens": []})], "cross_entropy", None, "data[0].model_input: no tokens"),
    (
        [Datum(list(range(10)) * 103, {"target_tokens": [1] * 1030})],
        "cross_entropy",
        None,
        "data[0].model_input: 1030 tokens, above the model's context of 1024",
    ),
    (
        [_is(advantages=[0.5, 0.5, 0.5, NAN, 0.5, 0.5, 0.5, 0.5])],
        "importance_sampling",
        None,
        "data[0].loss_fn_inputs.advantages[3]: not a finite number",
    ),
    (
        [_is(logprobs=[-1.0] * 7 + [-INF])],
        "ppo",
        None,
        "data[0].loss_fn_inputs.logprobs[7]: not a finite number",
    ),
    (
        [_is(advantages=["high"] * 8)],
        "importance_sampling",
        None,
        "data[0].loss_fn_inputs.advantages: expected a list of numbers",
    ),
    (
        [_is(advantages=None)],
        "importance_sampling",
        None,
        "data[0].loss_fn_inputs.advantages: missing",
    ),
    ([_is()], "gspo", None, "data[0].loss_fn_inputs.sequence_ratio_mask: missing"),
    (
        [_is(weights=[1.0] * 8)],
        "importance_sampling",
        None,
        "data[0].loss_fn_inputs.weights: not an input of importance_sampling",
    ),
    ([_is()], "ppo", {"clip_ratio": 0.2}, "loss_fn_config: unknown key(s) 'clip_ratio' for ppo"),
    (
        [Datum([1], {"target_tokens": [2]})],
        "cross_entropy",
        {"beta": 1.0},
        "loss_fn_config: unknown key(s) 'beta' for cross_entropy; it takes no config",
    ),
    ([_is()], "dro", {"beta": NAN}, "loss_fn_config.beta: not a finite number"),
    ([_is()], "dro", {"beta": -0.1}, "loss_fn_config.beta: must not be negative"),
    (
        [_is()],
        "ppo",
        {"clip_low_threshold": 1.3},
        "loss_fn_config.clip_low_threshold: 1.3 is above clip_high_threshold 1.2",
    ),
    (
        [_is(clip_low_threshold=[0.8] * 7 + [1.5])],
        "ppo",
        None,
        "data[0].loss_fn_inputs.clip_low_threshold[7]: 1.5 is above clip_high_threshold 1.2",
    ),
    (
        [_is(clip_high_threshold=[1.2] * 7 + [-1.0])],
        "cispo",
        None,
        "data[0].loss_fn_inputs.clip_high_threshold[7]: must not be negative",
    ),
]


@pytest.mark.parametrize(("data", "loss_fn", "config", "message"), CASES)
def test_hostile_calls_are_refused_naming_the_field_and_change_nothing(
    tiny_path: Path, data: list[Datum], loss_fn: str, config: dict[str, Any] | None, message: str
) -> None:
    session = new_session(tiny_path)
    with pytest.raises(PrimitiveError) as raised:
        session.forward_backward(data, loss_fn, config)
    assert message in str(raised.value)
    assert all(g is None for g in grads(session).values())


def test_an_unknown_loss_is_told_the_known_ones(tiny_path: Path) -> None:
    with pytest.raises(PrimitiveError) as raised:
        new_session(tiny_path).forward_backward([_is()], "grpo")
    assert all(name in str(raised.value) for name in LOSS_FUNCTIONS)


def test_the_token_budget_is_checked_over_the_whole_call(tiny_path: Path) -> None:
    session = new_session(tiny_path, max_tokens_per_call=12)
    session.forward_backward([_is(6), _is(6)], "importance_sampling")  # 12 fit
    with pytest.raises(
        PrimitiveError, match=r"data: 13 tokens in all, above this server's limit of 12"
    ):
        session.forward_backward([_is(6), _is(7)], "importance_sampling")


def test_an_error_in_a_later_datum_leaves_no_gradient_of_the_earlier_ones(tiny_path: Path) -> None:
    session = new_session(tiny_path, micro_batch_tokens=8)  # one datum per pass
    with pytest.raises(PrimitiveError, match=r"data\[2\]"):
        session.forward_backward([_is(), _is(), _is(advantages=[NAN] * 8)], "importance_sampling")
    assert all(g is None for g in grads(session).values())
