"""The losses of the Tinker training API by name, and what each one reads: the ``loss_fn``
names a ``forward_backward`` call may give, the ``loss_fn_inputs`` keys of its datums and the
``loss_fn_config`` keys with their defaults.

Torch-free and declared once: the API refuses a call whose loss or keys the worker would refuse
(app.tinker.admission) before the call is stored, and the trainer's registry
(``trainer.primitives.losses.LOSSES``) computes exactly these losses with these inputs (a test
holds the two equal).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "CLIP_HIGH",
    "CLIP_LOW",
    "LOSS_SIGNATURES",
    "TARGET_TOKENS",
    "UNSUPPORTED_LOSSES",
    "LossSignature",
]

TARGET_TOKENS = "target_tokens"  # int64 token ids, read by every loss
CLIP_LOW, CLIP_HIGH = "clip_low_threshold", "clip_high_threshold"


@dataclass(frozen=True)
class LossSignature:
    """What one loss reads.

    ``inputs``: required float ``loss_fn_inputs`` (``target_tokens`` is required by all and
    not listed). ``optional_inputs``: float inputs that may be left out, with the value each
    token then has. ``config``: scalar config keys with their defaults. ``per_token``: config
    keys a datum may also give per token as ``loss_fn_inputs`` (its values override the
    config's for that datum)."""

    inputs: tuple[str, ...] = ()
    optional_inputs: Mapping[str, float] = field(default_factory=dict)
    config: Mapping[str, float] = field(default_factory=dict)
    per_token: tuple[str, ...] = ()

    def required_inputs(self) -> tuple[str, ...]:
        """The ``loss_fn_inputs`` keys every datum must give, ``target_tokens`` first."""
        return (TARGET_TOKENS, *self.inputs)

    def input_names(self) -> tuple[str, ...]:
        """Every ``loss_fn_inputs`` key this loss reads, ``target_tokens`` first."""
        return (*self.required_inputs(), *self.optional_inputs, *self.per_token)


_POLICY_INPUTS = ("logprobs", "advantages")
_CLIPS = {CLIP_LOW: 0.8, CLIP_HIGH: 1.2}
_PER_TOKEN_CLIPS = (CLIP_LOW, CLIP_HIGH)

# The losses this server computes, in the SDK's order.
LOSS_SIGNATURES: dict[str, LossSignature] = {
    "cross_entropy": LossSignature(optional_inputs={"weights": 1.0}),
    "importance_sampling": LossSignature(_POLICY_INPUTS),
    "ppo": LossSignature(_POLICY_INPUTS, config=_CLIPS, per_token=_PER_TOKEN_CLIPS),
    "cispo": LossSignature(_POLICY_INPUTS, config=_CLIPS, per_token=_PER_TOKEN_CLIPS),
    "dro": LossSignature(_POLICY_INPUTS, config={"beta": 0.05}),
    "gspo": LossSignature(
        (*_POLICY_INPUTS, "sequence_ratio_mask"), config=_CLIPS, per_token=_PER_TOKEN_CLIPS
    ),
}

# Loss names the SDK knows that this server refuses, and why.
UNSUPPORTED_LOSSES: dict[str, str] = {
    "stable_reinforce": "it needs provenance recorded at sampling time, which this server does "
    "not keep",
    "custom": "server-side custom losses are not available; use forward_backward_custom, which "
    "runs the loss on the client",
}
