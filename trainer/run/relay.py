"""The channel between rank 0 of a job on several devices and the process that launched it:
the messages, both of its ends, and nothing else.

Rank 0 runs the training loop with :class:`RelayCallbacks`, which turns each callback into a
message on a ``multiprocessing.connection`` (an AF_UNIX socket whose address and authkey the
launcher puts in the environment). The launcher hands each message to :func:`deliver`, which
calls the real callbacks in the launcher's own thread, in the order rank 0 sent them.
``should_stop`` is the one question: rank 0 waits (bounded) for the answer. The run's end is
one last message, :class:`Finished` or :class:`Failed`.

Messages are pickled (that is what a Connection does); only a peer that knows the authkey can
connect, and both ends are this module. Nothing here imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection
from pathlib import Path

from trainer.errors import TrainerError
from trainer.run.callbacks import Callbacks, RolloutSample, RunInfo

__all__ = [
    "ADDRESS_ENV",
    "AUTHKEY_ENV",
    "Checkpointed",
    "Event",
    "Failed",
    "Finished",
    "Message",
    "RankException",
    "RelayCallbacks",
    "RelayTimeout",
    "Samples",
    "Started",
    "Stepped",
    "StopAnswer",
    "StopQuestion",
    "connect_from_env",
    "deliver",
]

ADDRESS_ENV = "GRPO_RELAY_ADDRESS"  # the launcher's AF_UNIX socket
AUTHKEY_ENV = "GRPO_RELAY_AUTHKEY"  # hex of the random key of this launch


class RelayTimeout(TrainerError):
    """The launcher did not answer rank 0 in time (it is stuck or gone). Retryable like a
    collective that timed out."""

    reason = "distributed_timeout"


class RankException(Exception):
    """Rank 0 ended with an error that is not a TrainerError (a bug, not a job's fault): raised
    in the launcher with the type and message; the traceback is in the ranks' output."""


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Started:
    info: RunInfo


@dataclass(frozen=True)
class Stepped:
    step: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class Event:
    kind: str
    message: str
    level: str = "info"
    data: dict[str, object] | None = None


@dataclass(frozen=True)
class Samples:
    step: int
    samples: list[RolloutSample]


@dataclass(frozen=True)
class Checkpointed:
    step: int
    path: Path


@dataclass(frozen=True)
class StopQuestion:
    """Rank 0 asks ``should_stop``; the launcher answers with :class:`StopAnswer`."""


@dataclass(frozen=True)
class StopAnswer:
    stop: bool


@dataclass(frozen=True)
class Finished:
    """The run returned: the fields of ``trainer.run.loop.TrainResult``."""

    final_step: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_path: Path | None = None
    stopped_early: bool = False


@dataclass(frozen=True)
class Failed:
    """The run raised. ``reason`` is a TrainerError's reason, or None for any other error
    (``error_type`` names its class)."""

    reason: str | None
    message: str
    error_type: str = "TrainerError"

    def exception(self) -> Exception:
        """The error to raise in the launcher."""
        if self.reason is None:
            return RankException(f"rank 0 failed: {self.error_type}: {self.message}")
        return TrainerError(self.message, reason=self.reason)


Message = (
    Started
    | Stepped
    | Event
    | Samples
    | Checkpointed
    | StopQuestion
    | StopAnswer
    | Finished
    | Failed
)


# --------------------------------------------------------------------------- rank 0's end


def connect_from_env(environ: dict[str, str] | None = None) -> Connection:
    """Rank 0's connection to its launcher, from :data:`ADDRESS_ENV` and :data:`AUTHKEY_ENV`."""
    env = os.environ if environ is None else environ
    try:
        address, key = env[ADDRESS_ENV], bytes.fromhex(env[AUTHKEY_ENV])
    except (KeyError, ValueError) as exc:
        raise RuntimeError(f"rank 0 has no launcher channel ({exc})") from None
    return Client(address, family="AF_UNIX", authkey=key)


class RelayCallbacks(Callbacks):
    """Rank 0's callbacks: every hook becomes a message to the launcher, whose callbacks run
    it; ``should_stop`` waits at most ``answer_timeout_s`` for the launcher's answer."""

    def __init__(
        self, conn: Connection, *, applies_retention: bool, answer_timeout_s: float
    ) -> None:
        self._conn = conn
        # Whoever receives the checkpoints decides whether the trainer prunes them: the
        # launcher's callbacks (the worker's apply the job's retention themselves).
        self.applies_retention = applies_retention
        self._timeout = answer_timeout_s

    def on_start(self, info: RunInfo) -> None:
        self._conn.send(Started(info))

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self._conn.send(Stepped(step, dict(metrics)))

    def on_event(
        self, kind: str, message: str, level: str = "info", data: dict[str, object] | None = None
    ) -> None:
        self._conn.send(Event(kind, message, level, dict(data) if data else None))

    def on_samples(self, step: int, samples: list[RolloutSample]) -> None:
        self._conn.send(Samples(step, list(samples)))

    def on_checkpoint(self, step: int, path: Path) -> None:
        self._conn.send(Checkpointed(step, Path(path)))

    def should_stop(self) -> bool:
        self._conn.send(StopQuestion())
        # The launcher answers once it has run every hook sent before the question (a
        # checkpoint's database writes retry for up to a minute or two), so the bound is long.
        if not self._conn.poll(self._timeout):
            raise RelayTimeout(f"the launcher did not answer should_stop in {self._timeout:g}s")
        answer = self._conn.recv()
        if not isinstance(answer, StopAnswer):
            raise RuntimeError(f"the launcher answered {type(answer).__name__}, not StopAnswer")
        return answer.stop

    def finish(self, message: Finished | Failed) -> None:
        """Send the run's last message and close the channel. A launcher that stopped
        listening (it is stopping the ranks) misses nothing it still wants."""
        try:
            self._conn.send(message)
        except OSError:
            pass
        finally:
            self._conn.close()


# --------------------------------------------------------------------------- launcher's end


def deliver(message: object, callbacks: Callbacks, conn: Connection) -> bool:
    """Run one message of rank 0 on the launcher's ``callbacks`` (answering a StopQuestion on
    ``conn``); True when it was the run's last message (Finished or Failed), which the caller
    then reads itself. A callback's exception propagates: the caller stops the ranks."""
    match message:
        case Started(info):
            callbacks.on_start(info)
        case Stepped(step, metrics):
            callbacks.on_step(step, metrics)
        case Event(kind, text, level, data):
            callbacks.on_event(kind, text, level, data)
        case Samples(step, samples):
            callbacks.on_samples(step, samples)
        case Checkpointed(step, path):
            callbacks.on_checkpoint(step, path)
        case StopQuestion():
            conn.send(StopAnswer(bool(callbacks.should_stop())))
        case Finished() | Failed():
            return True
        case _:
            raise RuntimeError(f"rank 0 sent an unknown message: {type(message).__name__}")
    return False
