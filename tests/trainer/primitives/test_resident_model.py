"""Gradients accumulate across ``forward_backward`` calls until ``optim_step``; a forward-only
call computes the same numbers and leaves no gradient."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import trainer.primitives.resident_model as session_module
from tests.trainer.primitives.conftest import assert_logprobs_close, grads, new_session
from trainer.primitives import Datum

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data() -> list[Datum]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for n in (4, 7, 2, 5):
        tokens = torch.randint(0, 57, (n,), generator=generator).tolist()
        out.append(
            Datum(
                tokens,
                {
                    "target_tokens": torch.randint(0, 57, (n,), generator=generator).tolist(),
                    "logprobs": (-3 + torch.rand(n, generator=generator)).tolist(),
                    "advantages": torch.randn(n, generator=generator).tolist(),
                },
            )
        )
    return out


def test_two_calls_accumulate_the_gradient_of_their_union(tiny_path: Path) -> None:
    data = _data()
    split = new_session(tiny_path, dtype=torch.float64)
    first = split.forward_backward(data[:1], "ppo")
    second = split.forward_backward(data[1:], "ppo")
    whole = new_session(tiny_path, dtype=torch.float64)
    union = whole.forward_backward(data, "ppo")

    assert first.metrics["loss:sum"] + second.metrics["loss:sum"] == pytest.approx(
        union.metrics["loss:sum"], rel=1e-12
    )
    assert_logprobs_close(first.logprobs + second.logprobs, union.logprobs, 1e-12)
    for (name, a), b in zip(grads(split).items(), grads(whole).values(), strict=True):
        assert a is not None and b is not None, name
        assert float((a - b).abs().max()) <= 1e-12 * max(1.0, float(b.abs().max()))


def test_forward_only_computes_the_same_and_leaves_no_gradient(tiny_path: Path) -> None:
    data = _data()
    session = new_session(tiny_path, dtype=torch.float64)
    forward = session.forward_backward(data, "importance_sampling", forward_only=True)
    assert all(g is None for g in grads(session).values())

    both = session.forward_backward(data, "importance_sampling")
    assert_logprobs_close(forward.logprobs, both.logprobs, 1e-12)
    assert forward.metrics == pytest.approx(both.metrics, rel=1e-12)
    after_backward = grads(session)
    assert all(g is not None for g in after_backward.values())

    session.forward_backward(data, "importance_sampling", forward_only=True)
    for g, kept in zip(grads(session).values(), after_backward.values(), strict=True):
        assert g is not None and kept is not None and torch.equal(g, kept)


def test_results_do_not_depend_on_how_a_call_is_micro_batched(tiny_path: Path) -> None:
    data = _data()
    one_pass = new_session(tiny_path, dtype=torch.float64, micro_batch_tokens=10_000)
    per_datum = new_session(tiny_path, dtype=torch.float64, micro_batch_tokens=1)
    a = one_pass.forward_backward(data, "cispo")
    b = per_datum.forward_backward(data, "cispo")
    assert_logprobs_close(a.logprobs, b.logprobs, 1e-12)
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-12)
    for x, y in zip(grads(one_pass).values(), grads(per_datum).values(), strict=True):
        assert x is not None and y is not None
        assert float((x - y).abs().max()) <= 1e-12 * max(1.0, float(y.abs().max()))


def test_metric_keys_have_one_colon_and_a_known_reduction(tiny_path: Path) -> None:
    session = new_session(tiny_path)
    result = session.forward_backward(_data(), "dro")
    metrics = {**result.metrics, **session.optim_step(learning_rate=1e-4)}
    for key in metrics:
        name, reduction = key.split(":")  # the SDK's own split: exactly one colon
        assert name and reduction in {"sum", "mean", "min", "max"}


def test_the_session_states_its_limits(tiny_path: Path) -> None:
    session = new_session(tiny_path)
    assert session.vocab_size == 57
    assert session.max_context == 1024
    assert (session.tokenizer_path / "tokenizer.json").is_file()


def test_a_call_that_fails_midway_adds_no_gradient(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass that fails after earlier micro-batches ran (out of memory, say) leaves the
    gradients as they were before the call, so a retry does not count them twice."""
    data = _data()
    session = new_session(tiny_path, dtype=torch.float64, micro_batch_tokens=1)
    session.forward_backward(data[:1], "ppo")
    before = grads(session)

    real = session_module.target_logprobs
    calls = []

    def failing_third_pass(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(session_module, "target_logprobs", failing_third_pass)
    with pytest.raises(MemoryError):
        session.forward_backward(data, "ppo")
    assert len(calls) == 3  # two passes had added their gradients
    for g, kept in zip(grads(session).values(), before.values(), strict=True):
        assert g is not None and kept is not None and torch.equal(g, kept)
