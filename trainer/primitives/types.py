"""The values the primitives take and return, and their one error type.

Field names follow the Tinker protocol where the caller sees them: an error message names
``model_input`` and ``loss_fn_inputs`` (what the SDK's user wrote), although :class:`Datum`
calls them ``tokens`` and ``inputs``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Datum", "ForwardResult", "PrimitiveError", "SampleResult", "SampledSequence"]


class PrimitiveError(ValueError):
    """Bad input from the caller (a 400 for the service). The message starts with the field it
    is about, e.g. ``data[3].loss_fn_inputs.advantages: 7 values for 8 tokens``."""


@dataclass(frozen=True)
class Datum:
    """One sequence of a ``forward_backward`` call.

    ``tokens``: the model input, N >= 1 token ids. ``inputs``: the loss function's inputs,
    each a list of N values aligned with ``tokens``: position t of ``target_tokens`` (ints) is
    the token predicted from ``tokens[: t + 1]``; the other inputs are floats (ints are read as
    floats)."""

    tokens: list[int]
    inputs: dict[str, list[float] | list[int]]


@dataclass
class ForwardResult:
    """What ``forward_backward`` (or a forward-only call) returns.

    ``logprobs[i][t]`` is ``log p(target_tokens[t] | tokens[: t + 1])`` of datum i at
    temperature 1 under the current weights. Every ``metrics`` key is ``name:reduction`` with
    exactly one colon (the SDK splits on it to combine chunks); ``loss:sum`` is the loss summed
    over every token and datum of the call."""

    logprobs: list[list[float]]
    metrics: dict[str, float]


@dataclass
class SampledSequence:
    """One sample: its tokens (a stop token, or the tokens of a stop string, included), the
    log-probability of each (see ``trainer.primitives.sampling``) and why it ended."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]


@dataclass
class SampleResult:
    """The samples of one prompt, and, when asked, the prompt's log-probabilities: one per
    prompt token, ``None`` at position 0 (nothing predicts the first token)."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None
