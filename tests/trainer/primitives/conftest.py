"""Sessions on the packaged tiny model for the primitives' tests, and what they share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.models.loading import resolve_model
from trainer.primitives import ResidentModel


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    return resolve_model("tiny-random-llama")


def new_session(path: Path, **overrides: Any) -> ResidentModel:
    """A rank-4 session (seed 0) whose adapters' B matrices are non-zero: B starts at 0,
    where the model is the base and every A gets a zero gradient, which would make checks of
    gradients and of the adapters' effect trivially true."""
    kwargs: dict[str, Any] = {"lora_rank": 4, "seed": 0, **overrides}
    session = ResidentModel(path, **kwargs)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in session.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.05)
    return session


def trainable(session: ResidentModel) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in session.model.named_parameters() if p.requires_grad}


def values(session: ResidentModel) -> dict[str, torch.Tensor]:
    """A copy of the trainable tensors."""
    return {n: p.detach().clone() for n, p in trainable(session).items()}


def grads(session: ResidentModel) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in trainable(session).items()}


def assert_logprobs_close(got: list[list[float]], want: list[list[float]], atol: float) -> None:
    """Same datums, same lengths, every value within ``atol``."""
    assert [len(row) for row in got] == [len(row) for row in want]
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(
            torch.tensor(a, dtype=torch.float64),
            torch.tensor(b, dtype=torch.float64),
            rtol=0,
            atol=atol,
        )
