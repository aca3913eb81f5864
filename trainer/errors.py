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


class ModelNotCached(TrainerError):
    """The job's Hub model (repo id and revision) is not in the worker's Hugging Face cache and
    the worker may not, or could not, download it. The message names the model and how the
    operator pre-fetches it, never a server path."""

    reason = "model_not_cached"


class ModelNotFound(TrainerError):
    """The Hub answered that the job's repo id or revision does not exist, or that this worker
    may not read it (private or gated)."""

    reason = "model_not_found"


class LoraTargetNotSupported(TrainerError):
    """``lora.target_modules`` reaches a module whose adapter the rollout engine and a merged
    export would not carry (an embedding, or an output head tied to the embeddings); the
    message names the module."""

    reason = "lora_target_not_supported"


class DistributedTimeout(TrainerError):
    """A collective of the job's ranks failed or did not complete within the timeout: a peer
    died, hung, or called a different collective (ranks out of step)."""

    reason = "distributed_timeout"

    def __init__(self, rank: int, phase: str, detail: str) -> None:
        super().__init__(f"rank {rank}: collective in phase {phase!r} failed: {detail}")
        self.rank = rank
        self.phase = phase


class RankFailed(TrainerError):
    """A rank of a job on several devices died or exited with an error before rank 0 reported
    the run's end (killed, out of memory, a crash); the message names the exit code and, when
    torchrun's report says, the rank. The job can resume from its last checkpoint."""

    reason = "rank_failed"
