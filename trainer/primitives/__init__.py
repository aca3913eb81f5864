"""The Tinker training primitives, trainer side: a resident LoRA model that a client drives
call by call (``forward_backward``, ``optim_step``, ``sample``, ``save_state``) instead of
submitting a whole job. The service (API, sessions, worker) is built on
:class:`ResidentModel`; this package knows nothing of it.

Modules: the values and the error (:mod:`~trainer.primitives.types`), the loss functions and
their registry (:mod:`~trainer.primitives.losses`), the checks of a call
(:mod:`~trainer.primitives.validation`), packing into padded micro-batches
(:mod:`~trainer.primitives.batch`), target log-probabilities
(:mod:`~trainer.primitives.scoring`), the adapters (:mod:`~trainer.primitives.adapters`), the
per-call AdamW step (:mod:`~trainer.primitives.adam`), sampling
(:mod:`~trainer.primitives.sampling`), saved states (:mod:`~trainer.primitives.state`), what a
saved state leaves out of a resident model, so that one written to disk and read back
continues exactly (:mod:`~trainer.primitives.resident`), and the resident model itself
(:mod:`~trainer.primitives.resident_model`).
"""

from trainer.primitives.adapters import WeightsSnapshot
from trainer.primitives.losses import LOSS_FUNCTIONS
from trainer.primitives.resident_model import ResidentModel
from trainer.primitives.types import (
    Datum,
    ForwardResult,
    PrimitiveError,
    SampledSequence,
    SampleResult,
)

__all__ = [
    "LOSS_FUNCTIONS",
    "Datum",
    "ForwardResult",
    "PrimitiveError",
    "ResidentModel",
    "SampleResult",
    "SampledSequence",
    "WeightsSnapshot",
]
