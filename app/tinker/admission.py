"""Admission: what a call the schema accepts may still not ask of the model it runs on or of
this server, checked in the API before the call is stored (a refused body is never written to
tinker_requests). The worker checks again (trainer.primitives.validation and sampling), by the
same rules: this is the first gate, not the only one.

- The model's facts come from its packaged model's shape (jobspec.model_shape, torch-free):
  token ids in ``[0, vocab_size)`` and at most ``max_position_embeddings`` tokens a sequence.
- A forward_backward or forward call names a loss this server computes, gives each datum the
  ``loss_fn_inputs`` keys that loss reads and needs (jobspec.tinker_losses), integer target
  tokens and finite float inputs, and only ``loss_fn_config`` keys the loss takes, as numbers.
- A sample call's prompt and ``max_tokens`` fit the model's context, and its batch
  (``num_samples x (prompt tokens + max_tokens)``, what the sampler's KV cache holds) fits
  GRPO_TINKER_MAX_SAMPLE_BATCH_TOKENS.

Every refusal is a 400 the SDK does not retry (``TinkerBadRequest``), naming the field as the
SDK's user wrote it (``data[2].loss_fn_inputs.advantages``), its ``param`` too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from app.core.settings import Settings
from app.core.tinker_tables import TinkerModel
from app.tinker.service import TinkerBadRequest
from app.tinker.wire import FwdBwdRequest, WireDatum
from jobspec.model_shape import ModelShape, preset_shape
from jobspec.tinker_losses import (
    LOSS_SIGNATURES,
    TARGET_TOKENS,
    UNSUPPORTED_LOSSES,
    LossSignature,
)


@dataclass(frozen=True)
class ModelLimits:
    """What one sequence may hold on a model: token ids below ``vocab_size``, at most
    ``max_context`` tokens (prompt and sample together)."""

    vocab_size: int
    max_context: int


def packaged_shape(model: TinkerModel) -> ModelShape | None:
    """The shape of the packaged model a training client trains (its alias's, when it named
    one); None for a model without a known shape (its calls are checked on the worker)."""
    return preset_shape(model.model_trained)


def model_limits(model: TinkerModel) -> ModelLimits | None:
    """The model's limits, from its packaged model's shape (None when it is not known)."""
    shape = packaged_shape(model)
    if shape is None or shape.max_position_embeddings < 1:
        return None
    return ModelLimits(shape.vocab_size, shape.max_position_embeddings)


def _refuse(field: str, problem: str) -> TinkerBadRequest:
    return TinkerBadRequest(f"{field}: {problem}", param=field)


def _check_ids(ids: Sequence[int], field: str, vocab_size: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        j = next(j for j, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise _refuse(
            f"{field}[{j}]",
            f"token id {ids[j]} is outside the vocabulary (0 to {vocab_size - 1})",
        )


# -- forward_backward and forward ---------------------------------------------------------------


def loss_signature(name: str) -> LossSignature:
    """What the loss ``name`` reads; a 400 naming ``loss_fn`` for one this server refuses or
    does not know."""
    if name in UNSUPPORTED_LOSSES:
        raise _refuse(
            "loss_fn", f"{name!r} is not supported by this server: {UNSUPPORTED_LOSSES[name]}"
        )
    signature = LOSS_SIGNATURES.get(name)
    if signature is None:
        raise _refuse(
            "loss_fn",
            f"unknown loss {name!r:.80}; this server computes {', '.join(LOSS_SIGNATURES)}",
        )
    return signature


def _check_config(name: str, signature: LossSignature, config: Mapping[str, float | str]) -> None:
    for key, value in config.items():
        field = f"loss_fn_config.{key:.80}"
        if key not in signature.config:
            takes = ", ".join(signature.config) if signature.config else "no config"
            raise _refuse(field, f"not a config key of {name} (it takes {takes})")
        if isinstance(value, str):
            raise _refuse(field, "expected a number, got text")
        if not math.isfinite(value):
            raise _refuse(field, f"not a finite number ({value})")


def _check_datum(
    datum: WireDatum, where: str, name: str, signature: LossSignature, limits: ModelLimits | None
) -> None:
    n = len(datum.tokens)
    if limits is not None:
        if n > limits.max_context:
            raise _refuse(
                f"{where}.model_input",
                f"{n} tokens, above the model's context of {limits.max_context}",
            )
        _check_ids(datum.tokens, f"{where}.model_input", limits.vocab_size)
    fields = f"{where}.loss_fn_inputs"
    reads = signature.input_names()
    unknown = sorted(set(datum.inputs) - set(reads))
    if unknown:
        raise _refuse(
            f"{fields}.{unknown[0]:.80}", f"not an input of {name} (it reads {', '.join(reads)})"
        )
    needs = signature.required_inputs()
    missing = [key for key in needs if key not in datum.inputs]
    if missing:
        raise _refuse(f"{fields}.{missing[0]}", f"missing ({name} needs {', '.join(needs)})")
    for key, values in datum.inputs.items():
        field = f"{fields}.{key}"
        if key == TARGET_TOKENS:
            if not all(type(v) is int for v in values):
                raise _refuse(field, "expected integer token ids (an int64 tensor)")
            if limits is not None:
                _check_ids(cast(list[int], values), field, limits.vocab_size)
        elif not all(map(math.isfinite, values)):
            j = next(j for j, v in enumerate(values) if not math.isfinite(v))
            raise _refuse(f"{field}[{j}]", f"not a finite number ({values[j]})")


def check_forward_backward(call: FwdBwdRequest, limits: ModelLimits | None) -> None:
    """A decoded forward_backward (or forward) call against its loss and its model (None:
    a model of unknown shape, whose token ids and lengths the worker checks)."""
    signature = loss_signature(call.loss_fn)
    _check_config(call.loss_fn, signature, call.config)
    for i, datum in enumerate(call.data):
        _check_datum(datum, f"data[{i}]", call.loss_fn, signature, limits)


# -- sample -------------------------------------------------------------------------------------


def sample_max_tokens(max_tokens: int | None, settings: Settings) -> int:
    """The tokens a sample call may generate: its own ``max_tokens``, else the server's
    (what the worker uses, worker/tinker_requests.py)."""
    return max_tokens or settings.tinker_max_sample_tokens


def check_sample(
    prompt: Sequence[int],
    num_samples: int,
    max_tokens: int,
    settings: Settings,
    limits: ModelLimits | None,
) -> None:
    """A sample call's prompt against the model, and its batch against the server's budget."""
    if limits is not None:
        _check_ids(prompt, "prompt", limits.vocab_size)
        if len(prompt) + max_tokens > limits.max_context:
            raise _refuse(
                "sampling_params.max_tokens",
                f"{len(prompt)} prompt tokens + {max_tokens} exceed the model's context of "
                f"{limits.max_context}",
            )
    budget = settings.tinker_max_sample_batch_tokens
    tokens = num_samples * (len(prompt) + max_tokens)
    if tokens > budget:
        raise TinkerBadRequest(
            f"num_samples: {num_samples} samples x ({len(prompt)} prompt tokens + {max_tokens} "
            f"max_tokens) = {tokens} tokens, over this server's {budget} tokens a sample call "
            "(GRPO_TINKER_MAX_SAMPLE_BATCH_TOKENS); ask for fewer samples or tokens a call",
            param="num_samples",
        )
