"""Errors a training run can end with. ``reason`` is a stable machine-readable code that the
service stores as the job's failure reason."""

from __future__ import annotations


class TrainerError(Exception):
    """Base class of the trainer's own failures."""

    reason: str = "trainer_error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class NonFiniteLossError(TrainerError):
    """Several updates in a row had a non-finite loss or gradient norm."""

    reason = "non_finite_loss"


class ModelNotAllowed(TrainerError):
    """The job's ``model`` names a folder outside the model roots this worker may read. The
    message depends only on the configuration, never on the path asked for, so a refusal does
    not tell whether that path exists."""

    reason = "model_not_allowed"
