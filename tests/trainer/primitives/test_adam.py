"""``optim_step`` is torch's AdamW with each call's settings, on the accumulated gradients."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tests.trainer.primitives.conftest import grads, new_session, trainable, values
from trainer.primitives import Datum, PrimitiveError, ResidentModel
from trainer.primitives.adam import AdamParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(seed: int) -> list[Datum]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for n in (6, 4):
        tokens = torch.randint(0, 57, (n,), generator=generator).tolist()
        targets = torch.randint(0, 57, (n,), generator=generator).tolist()
        out.append(Datum(tokens, {"target_tokens": targets}))
    return out


def _reference_step(
    reference: list[torch.Tensor],
    optimizer: torch.optim.AdamW,
    gradients: list[torch.Tensor],
    settings: AdamParams,
) -> None:
    """What a torch user writes: set the group's settings, clip, step."""
    for param, grad in zip(reference, gradients, strict=True):
        param.grad = grad.clone()
    for group in optimizer.param_groups:
        group["lr"] = settings.learning_rate
        group["betas"] = (settings.beta1, settings.beta2)
        group["eps"] = settings.eps
        group["weight_decay"] = settings.weight_decay
    if settings.grad_clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(reference, settings.grad_clip_norm)
    optimizer.step()


def _session(tiny_path: Path) -> ResidentModel:
    return new_session(tiny_path, dtype=torch.float64)


def test_steps_equal_torch_adamw_with_per_call_settings_and_clipping(tiny_path: Path) -> None:
    session = _session(tiny_path)
    reference = [v.clone().requires_grad_(True) for v in values(session).values()]
    optimizer = torch.optim.AdamW(reference)
    steps = [
        AdamParams(1e-2, grad_clip_norm=0.5),  # the clip binds
        AdamParams(3e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1),
        AdamParams(1e-3, weight_decay=0.01, grad_clip_norm=1e6),  # the clip is idle
    ]
    for i, step in enumerate(steps):
        session.forward_backward(_data(i), "cross_entropy")
        gradients = [g for g in grads(session).values() if g is not None]
        norm = math.sqrt(sum(float((g**2).sum()) for g in gradients))
        if i == 0:
            assert norm > 0.5  # so the first step's clipping does act
        metrics = session.optim_step(**asdict(step))
        _reference_step(reference, optimizer, gradients, step)
        for got, want in zip(values(session).values(), reference, strict=True):
            assert torch.equal(got, want.detach())
        assert metrics["optim/grad_norm:mean"] == pytest.approx(norm, rel=1e-12)
        assert metrics["optim/step:max"] == i + 1
        assert all(g is None for g in grads(session).values())  # applied, then cleared
    assert session.steps == 3


def test_a_non_finite_gradient_skips_the_step_and_clears_the_gradients(tiny_path: Path) -> None:
    session = _session(tiny_path)
    session.forward_backward(_data(0), "cross_entropy")
    session.optim_step(learning_rate=1e-2)
    before = values(session)
    session.forward_backward(_data(1), "cross_entropy")
    next(iter(trainable(session).values())).grad[0, 0] = math.nan  # type: ignore[index]
    metrics = session.optim_step(learning_rate=1e-2)
    assert metrics["optim/skipped:sum"] == 1.0 and session.steps == 1
    assert all(
        torch.equal(a, b) for a, b in zip(values(session).values(), before.values(), strict=True)
    )
    assert all(g is None for g in grads(session).values())


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"learning_rate": -1e-3}, "adam_params.learning_rate"),
        ({"learning_rate": math.nan}, "adam_params.learning_rate"),
        ({"learning_rate": 1e-3, "beta1": 1.0}, "adam_params.beta1"),
        ({"learning_rate": 1e-3, "beta2": 1.5}, "adam_params.beta2"),
        ({"learning_rate": 1e-3, "eps": -1.0}, "adam_params.eps"),
        ({"learning_rate": 1e-3, "grad_clip_norm": math.inf}, "adam_params.grad_clip_norm"),
    ],
)
def test_bad_adam_settings_are_refused_without_touching_anything(
    tiny_path: Path, settings: dict[str, float], field: str
) -> None:
    session = _session(tiny_path)
    session.forward_backward(_data(0), "cross_entropy")
    before, pending = values(session), grads(session)
    with pytest.raises(PrimitiveError, match=field):
        session.optim_step(**settings)
    assert all(
        torch.equal(a, b) for a, b in zip(values(session).values(), before.values(), strict=True)
    )
    assert all(
        g is not None and p is not None and torch.equal(g, p)
        for g, p in zip(grads(session).values(), pending.values(), strict=True)
    )
