"""Checks of a ``forward_backward`` call before anything is computed: the loss name, its
config, and every datum against the loss, the vocabulary, the context and the call's token
budget. Each failure is a :class:`PrimitiveError` naming the field as the SDK's user wrote it
(``loss_fn``, ``loss_fn_config.beta``, ``data[3].loss_fn_inputs.advantages[5]``).

A checked datum comes back as tensors (:class:`CheckedDatum`): the conversion is the type
check, and packing (``trainer.primitives.batch``) reuses them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from jobspec.tinker_losses import CLIP_HIGH, CLIP_LOW, TARGET_TOKENS, UNSUPPORTED_LOSSES
from trainer.primitives.losses import LOSS_FUNCTIONS, LOSSES, LossFunction
from trainer.primitives.types import Datum, PrimitiveError

__all__ = ["CheckedDatum", "Limits", "check_data", "resolve_config", "resolve_loss"]

# Config values (and per-token inputs of the same names) that must not be negative.
_NON_NEGATIVE = frozenset({CLIP_LOW, CLIP_HIGH, "beta"})


@dataclass(frozen=True)
class Limits:
    """What a call may hold: token ids below ``vocab_size``, at most ``max_context`` tokens a
    datum and ``max_tokens`` in all."""

    vocab_size: int
    max_context: int
    max_tokens: int


@dataclass(frozen=True)
class CheckedDatum:
    """A datum that passed :func:`check_data`: ``tokens`` and ``targets`` [N] int64, and
    ``inputs``, the float inputs the datum gave (float64 [N] each)."""

    tokens: Tensor
    targets: Tensor
    inputs: dict[str, Tensor]


def resolve_loss(name: str) -> LossFunction:
    """The registered loss ``name``; PrimitiveError for an unsupported or unknown one."""
    if name in UNSUPPORTED_LOSSES:
        raise PrimitiveError(
            f"loss_fn: {name!r} is not supported by this server: {UNSUPPORTED_LOSSES[name]}"
        )
    loss = LOSSES.get(name)
    if loss is None:
        raise PrimitiveError(
            f"loss_fn: unknown loss {name!r:.80}; this server computes {', '.join(LOSS_FUNCTIONS)}"
        )
    return loss


def resolve_config(
    name: str, loss: LossFunction, config: Mapping[str, float] | None
) -> dict[str, float]:
    """The loss's config: its defaults updated with ``config``. PrimitiveError for a key the
    loss does not take, a value that is not a finite number, a negative threshold or beta, or
    a low clip threshold above the high one."""
    given = dict(config or {})
    unknown = sorted(set(given) - set(loss.config))
    if unknown:
        takes = ", ".join(loss.config) if loss.config else "no config"
        listed = ", ".join(repr(k)[:80] for k in unknown[:5])
        raise PrimitiveError(
            f"loss_fn_config: unknown key(s) {listed} for {name}; it takes {takes}"
        )
    resolved = dict(loss.config)
    for key, value in given.items():
        field = f"loss_fn_config.{key}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PrimitiveError(f"{field}: expected a number, got {type(value).__name__}")
        if not math.isfinite(value):
            raise PrimitiveError(f"{field}: not a finite number ({value})")
        if key in _NON_NEGATIVE and value < 0:
            raise PrimitiveError(f"{field}: must not be negative, got {value}")
        resolved[key] = float(value)
    if CLIP_LOW in resolved and resolved[CLIP_LOW] > resolved[CLIP_HIGH]:
        raise PrimitiveError(
            f"loss_fn_config.{CLIP_LOW}: {resolved[CLIP_LOW]} is above "
            f"{CLIP_HIGH} {resolved[CLIP_HIGH]}"
        )
    return resolved


def check_data(
    data: Sequence[Datum],
    loss: LossFunction,
    name: str,
    config: Mapping[str, float],
    limits: Limits,
) -> list[CheckedDatum]:
    """Every datum of a call checked and converted, or PrimitiveError at the first bad field.

    The token budget is checked first, from the lengths alone, so an oversized call is
    refused before its values are read."""
    if not data:
        raise PrimitiveError("data: no datums")
    total = sum(len(d.tokens) for d in data)
    if total > limits.max_tokens:
        raise PrimitiveError(
            f"data: {total} tokens in all, above this server's limit of {limits.max_tokens} a call"
        )
    return [_check_datum(d, f"data[{i}]", loss, name, config, limits) for i, d in enumerate(data)]


def _check_datum(
    datum: Datum,
    where: str,
    loss: LossFunction,
    name: str,
    config: Mapping[str, float],
    limits: Limits,
) -> CheckedDatum:
    n = len(datum.tokens)
    if n == 0:
        raise PrimitiveError(f"{where}.model_input: no tokens")
    if n > limits.max_context:
        raise PrimitiveError(
            f"{where}.model_input: {n} tokens, above the model's context of {limits.max_context}"
        )
    tokens = _token_ids(datum.tokens, f"{where}.model_input", limits.vocab_size)
    fields = f"{where}.loss_fn_inputs"
    accepted = loss.input_names()
    unknown = sorted(set(datum.inputs) - set(accepted))
    if unknown:
        raise PrimitiveError(
            f"{fields}.{unknown[0]:.80}: not an input of {name} (it reads {', '.join(accepted)})"
        )
    for key in (TARGET_TOKENS, *loss.inputs):
        if key not in datum.inputs:
            raise PrimitiveError(
                f"{fields}.{key}: missing ({name} needs {', '.join((TARGET_TOKENS, *loss.inputs))})"
            )
    for key, values in datum.inputs.items():
        if len(values) != n:
            raise PrimitiveError(f"{fields}.{key}: {len(values)} values for {n} tokens")
    targets = _token_ids(
        datum.inputs[TARGET_TOKENS], f"{fields}.{TARGET_TOKENS}", limits.vocab_size
    )
    inputs = {
        key: _floats(values, f"{fields}.{key}")
        for key, values in datum.inputs.items()
        if key != TARGET_TOKENS
    }
    if CLIP_LOW in loss.per_token:
        _check_thresholds(inputs, config, fields)
    return CheckedDatum(tokens, targets, inputs)


def _token_ids(values: Sequence[int] | Sequence[float], field: str, vocab_size: int) -> Tensor:
    """[N] int64 ids, each in ``[0, vocab_size)``."""
    try:
        ids = torch.tensor(list(values))
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise PrimitiveError(f"{field}: expected a list of integer token ids") from None
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise PrimitiveError(f"{field}: expected a list of integer token ids")
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        raise PrimitiveError(
            f"{field}[{j}]: token id {int(ids[j])} is outside the vocabulary (0 to {vocab_size - 1})"
        )
    return ids


def _floats(values: Sequence[float], field: str) -> Tensor:
    """[N] float64 values, every one finite."""
    if any(isinstance(v, bool) for v in values):
        raise PrimitiveError(f"{field}: expected a list of numbers, got booleans")
    try:
        out = torch.tensor(list(values), dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise PrimitiveError(f"{field}: expected a list of numbers") from None
    if out.dim() != 1:
        raise PrimitiveError(f"{field}: expected a list of numbers")
    bad = (~torch.isfinite(out)).nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        raise PrimitiveError(f"{field}[{j}]: not a finite number ({float(out[j])})")
    return out


def _check_thresholds(
    inputs: Mapping[str, Tensor], config: Mapping[str, float], fields: str
) -> None:
    """Per-token clip thresholds (the datum's, else the config's): not negative, low <= high."""
    for key in (CLIP_LOW, CLIP_HIGH):
        given = inputs.get(key)
        if given is not None and bool((given < 0).any()):
            j = int((given < 0).nonzero()[0, 0])
            raise PrimitiveError(
                f"{fields}.{key}[{j}]: must not be negative, got {float(given[j])}"
            )
    if CLIP_LOW not in inputs and CLIP_HIGH not in inputs:
        return  # the config's pair was checked by resolve_config
    n = next(inputs[k].numel() for k in (CLIP_LOW, CLIP_HIGH) if k in inputs)
    low = inputs.get(CLIP_LOW, torch.full((n,), config[CLIP_LOW], dtype=torch.float64))
    high = inputs.get(CLIP_HIGH, torch.full((n,), config[CLIP_HIGH], dtype=torch.float64))
    above = (low > high).nonzero()
    if above.numel():
        j = int(above[0, 0])
        raise PrimitiveError(
            f"{fields}.{CLIP_LOW}[{j}]: {float(low[j])} is above {CLIP_HIGH} {float(high[j])}"
        )
