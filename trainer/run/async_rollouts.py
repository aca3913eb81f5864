"""Asynchronous GRPO's rollout pipeline (docs/trainer.md): the rollouts of steps ``t+1..t+K`` are
generated in a rollout server (a process of its own, :mod:`trainer.rollout.remote_engine`)
while step ``t`` updates.

The schedule is fixed, not first-come: step ``t`` trains on samples of policy version
``behaviour_version(t, K) = max(0, t - 1 - K)`` (version ``v``: the weights after step ``v``),
exactly that one. A producer thread generates step ``s`` as soon as version
``behaviour_version(s, K)`` is published, and at most ``K`` steps ahead of the update. A run
resumed at step ``r`` holds no version below ``r`` (the checkpoint keeps the weights of step
``r`` alone), so the steps it makes itself sample with ``max(r, t - 1 - K)``: the schedule's
version or, right after the resume, the resumed weights (less stale, never more). So:

- the samples of every step are what they would be whatever the timing (each generate call is
  seeded by step and round, ``trainer.scoring.collect``), and a run reproduces;
- ``K = 0`` would be the synchronous step; the loop runs that without this module;
- at a checkpoint after step ``t`` the producer has made steps ``t+1..t+K`` and waits for
  version ``t`` (published only after the checkpoint): the checkpoint stores those batches and
  the data sampler's position after them (:func:`pending_to_json`), and a resume continues with
  exactly the samples the straight run would have trained on;
- the checkpoint also records K and the data sampler's position before each batch made ahead,
  so a resume with another K (or a synchronous one) samples those steps again from there
  instead of dropping or skipping their prompts (:func:`plan_resume`).

Every sample carries the version that generated it (``Completion.policy_version``, from the
server). :func:`drop_stale` is the guard that no sample older than ``K`` versions reaches an
update (a group with one is dropped whole: its advantages are over all of it).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from trainer.rollout.base import Completion
from trainer.scoring.collect import Collected, Group

__all__ = [
    "PENDING_KEY",
    "SAMPLER_BEFORE_KEY",
    "STALENESS_KEY",
    "ResumePlan",
    "RolloutPipeline",
    "behaviour_version",
    "drop_stale",
    "pending_from_json",
    "pending_to_json",
    "plan_resume",
    "staleness_metrics",
]

# Where a checkpoint's manifest (``extra``) keeps the batches made ahead, the data sampler's
# state before each of them (by step), and the K the run had (every run's checkpoint: 0 for a
# synchronous one).
PENDING_KEY = "async_pending"
SAMPLER_BEFORE_KEY = "async_sampler_before"
STALENESS_KEY = "max_staleness"

# Producer -> the batch of one step, sampled with the given version's weights.
Produce = Callable[[int, int], Collected]


def behaviour_version(step: int, max_staleness: int, oldest: int = 0) -> int:
    """The policy version step ``step`` (1-based) trains on: ``max(oldest, step - 1 - K)``,
    where ``oldest`` is the first version the run published (0, or the step it resumed at)."""
    return max(oldest, step - 1 - max_staleness)


def _version(completion: Completion, fallback: int) -> int:
    return fallback if completion.policy_version is None else completion.policy_version


def drop_stale(collected: Collected, step: int, max_staleness: int) -> int:
    """Remove from ``collected.kept`` every group holding a sample more than ``max_staleness``
    versions behind step ``step``'s update (version < ``step - 1 - K``); the number of samples
    dropped with them. A sample without a version counts as current."""
    oldest = step - 1 - max_staleness
    kept, dropped = [], 0
    for group in collected.kept:
        if any(_version(c, step - 1) < oldest for c in group.completions):
            dropped += len(group.completions)
        else:
            kept.append(group)
    collected.kept = kept
    return dropped


def staleness_metrics(collected: Collected, step: int, max_staleness: int) -> dict[str, float]:
    """``async/staleness_mean`` and ``async/staleness_max`` over the kept samples (how many
    versions each is behind the weights the update starts from, ``step - 1``), and
    ``async/staleness_count/<k>``, the histogram, for k in 0..K."""
    lags = [step - 1 - _version(c, step - 1) for g in collected.kept for c in g.completions]
    if not lags:
        return {}
    out = {
        "async/staleness_mean": sum(lags) / len(lags),
        "async/staleness_max": float(max(lags)),
    }
    for k in range(max_staleness + 1):
        out[f"async/staleness_count/{k}"] = float(sum(lag == k for lag in lags))
    return out


class RolloutPipeline:
    """Runs ``produce(step, version)`` for steps ``first..last`` in a thread, each as soon as
    its version is published and it is at most ``K`` steps ahead of what the loop took.

    The loop calls :meth:`take` for each step's batch, :meth:`publish` once the weights after a
    step are in the server and that step's checkpoint (if any) is written, and
    :meth:`settle` before writing a checkpoint. A producer error is raised by :meth:`take`."""

    def __init__(
        self,
        produce: Produce,
        *,
        max_staleness: int,
        first_step: int,
        last_step: int,
        published: int,
        pending: dict[int, Collected] | None = None,
    ) -> None:
        self._produce = produce
        self._k = max_staleness
        self._last = last_step
        self._published = published
        self._oldest = published  # no version below the first one published exists
        self._ready: dict[int, Collected] = dict(pending or {})
        self._next = max([first_step - 1, *self._ready]) + 1
        self._taken = first_step - 1
        self._error: BaseException | None = None
        self._stopping = False
        self._busy = 0.0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _may_produce(self) -> bool:
        """Under the lock: the next step's version is published and it is at most K ahead."""
        step = self._next
        version = behaviour_version(step, self._k, self._oldest)
        return self._published >= version and step - self._taken <= self._k

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and self._next <= self._last and not self._may_produce():
                    self._cond.wait()
                if self._stopping or self._next > self._last:
                    return
                step = self._next
            clock = time.perf_counter()
            try:
                collected = self._produce(step, behaviour_version(step, self._k, self._oldest))
            except BaseException as exc:  # handed to the loop by take()
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[step] = collected
                self._next = step + 1
                self._busy += time.perf_counter() - clock
                self._cond.notify_all()

    def _wait(self, done: Callable[[], bool]) -> None:
        """Under the lock: wait until ``done()``; raise the producer's error if it failed."""
        while not done():
            if self._error is not None:
                raise self._error
            if not self._thread.is_alive() and not done():
                raise RuntimeError("the rollout producer stopped")
            self._cond.wait(timeout=1.0)

    def take(self, step: int) -> tuple[Collected, float]:
        """Step ``step``'s batch (waiting for it) and the seconds the caller waited."""
        clock = time.perf_counter()
        with self._cond:
            self._wait(lambda: step in self._ready)
            collected = self._ready.pop(step)
            self._taken = max(self._taken, step)
            self._cond.notify_all()
        return collected, time.perf_counter() - clock

    def publish(self, version: int) -> None:
        """Version ``version``'s weights are in the server: steps that sample with it may run."""
        with self._cond:
            self._published = max(self._published, version)
            self._cond.notify_all()

    def settle(self, step: int) -> dict[int, Collected]:
        """Before step ``step``'s checkpoint (whose version is not published yet): wait until
        the producer made every step it can (up to ``step + K``); the batches made but not yet
        taken, by step. The producer is then idle until the next :meth:`publish`, so the data
        sampler's position is that after those batches."""
        last = min(step + self._k, self._last)
        with self._cond:
            self._wait(lambda: self._next > last)
            return dict(self._ready)

    def busy_seconds(self) -> float:
        """Seconds the producer has spent generating and scoring so far."""
        with self._cond:
            return self._busy

    def stop(self, timeout: float = 30.0) -> None:
        """Stop producing (a call in progress ends with the server's close)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)


# ---------------------------------------------------------------- resuming with another K


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What a resume does with the batches its checkpoint made ahead: keeps them (``pending``,
    JSON by step, with the data sampler's state before each), or drops them and restores the
    data sampler to ``rewind_to``, the state before the first of them, so that the run samples
    those steps' prompts again (``note`` says so, for the resume's event)."""

    pending: dict[str, Any]
    sampler_before: dict[str, Any]
    rewind_to: dict[str, Any] | None = None
    note: str | None = None


def plan_resume(extra: dict[str, Any], *, step: int, max_staleness: int) -> ResumePlan:
    """How a run with ``max_staleness`` resumes from step ``step``'s checkpoint (its manifest's
    ``extra``). Same K, or nothing made ahead: as written. Another K: the batches made ahead
    were sampled for the old schedule (a lower K would train them staler than it allows, and
    K = 0 has no producer to take them), so they are sampled again from the data position
    before them: no prompt is dropped or skipped. A checkpoint written before K was recorded
    keeps its batches where they fit the new K, else ValueError saying why."""
    pending: dict[str, Any] = extra.get(PENDING_KEY) or {}
    before: dict[str, Any] = extra.get(SAMPLER_BEFORE_KEY) or {}
    written_with = extra.get(STALENESS_KEY)
    if not pending or written_with == max_staleness:
        return ResumePlan(pending, before)
    steps = sorted(int(s) for s in pending)
    made = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    first = before.get(str(steps[0]))
    if written_with is not None and first is not None:
        note = (
            f"grpo.async.max_staleness {written_with} -> {max_staleness}: the batches made "
            f"ahead for {made} are sampled again, from the data position before them"
        )
        return ResumePlan({}, {}, rewind_to=first, note=note)
    lag = max(_lags(pending_from_json(pending)), default=0)
    if max_staleness >= 1 and lag <= max_staleness:
        return ResumePlan(pending, before)
    raise ValueError(
        f"checkpoint-{step} keeps batches made ahead for {made}, sampled {lag} version(s) "
        f"behind, more than grpo.async.max_staleness {max_staleness} allows; it was written "
        "before checkpoints recorded the data position before them, so they cannot be sampled "
        f"again: resume it with grpo.async.max_staleness {lag} or more"
    )


def _lags(pending: dict[int, Collected]) -> list[int]:
    """How many versions each kept sample of the batches made ahead lags its step's update."""
    return [
        step - 1 - _version(c, step - 1)
        for step, collected in pending.items()
        for group in collected.kept
        for c in group.completions
    ]


# ---------------------------------------------------------------- checkpointed batches


def pending_to_json(pending: dict[int, Collected]) -> dict[str, Any]:
    """The batches a checkpoint keeps (made, not yet trained on) as JSON-ready data."""
    return {str(step): _collected_to_json(c) for step, c in sorted(pending.items())}


def pending_from_json(data: dict[str, Any]) -> dict[int, Collected]:
    """The inverse of :func:`pending_to_json`."""
    return {int(step): _collected_from_json(c) for step, c in data.items()}


def _collected_to_json(collected: Collected) -> dict[str, Any]:
    kept = {id(g) for g in collected.kept}
    fields = {f.name: getattr(collected, f.name) for f in dataclasses.fields(collected)}
    fields["groups"] = [dataclasses.asdict(g) for g in collected.groups]
    fields["kept"] = [i for i, g in enumerate(collected.groups) if id(g) in kept]
    fields["rollout_metrics"] = [list(pair) for pair in collected.rollout_metrics]
    return fields


def _collected_from_json(data: dict[str, Any]) -> Collected:
    groups = [
        Group(**{**g, "completions": [Completion(**c) for c in g["completions"]]})
        for g in data["groups"]
    ]
    values = dict(data)
    values["groups"] = groups
    values["kept"] = [groups[i] for i in data["kept"]]
    values["rollout_metrics"] = [(int(n), dict(m)) for n, m in data["rollout_metrics"]]
    return Collected(**values)
