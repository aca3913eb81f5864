"""How a training run reports progress: the interface the service's worker implements.

The trainer calls these hooks; it never knows where the data goes (a database, a terminal, a
test's list). Every hook has a no-op default, so a subclass overrides only what it needs.
Hooks run on the training thread: keep them quick, and let them raise only to abort the run.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

__all__ = [
    "CallbackList",
    "Callbacks",
    "CompletionSample",
    "ConsoleCallbacks",
    "MetricsFile",
    "RolloutSample",
    "RunInfo",
]


@dataclass(frozen=True)
class RunInfo:
    """What a run is about to do; passed to :meth:`Callbacks.on_start`."""

    total_steps: int
    start_step: int  # steps already done (0, or the step of the checkpoint resumed from)
    model_path: Path | None  # None when the caller passed a ready model object
    output_dir: Path
    device: str  # the trainer's torch device ("cpu", "cuda:0")
    engine: str  # rollout engine kind ("vllm", "transformers"), or the class of a passed engine
    resumed_from: Path | None = None


@dataclass(frozen=True)
class CompletionSample:
    text: str
    reward: float  # total (weighted) task reward, before shaping
    rewards: dict[str, float]  # unweighted score per grader
    advantage: float  # 0.0 for a group dropped by dynamic sampling
    num_tokens: int
    finish_reason: str  # "stop" (eos) or "length" (hit max_new_tokens)
    # An agent episode's turns (model turns with their tool calls, tool results, environment
    # messages) and why it ended, bounded: JSON of trainer.agents.sample_transcript, where the
    # bounds are. None for a single completion.
    transcript: dict[str, Any] | None = None


@dataclass(frozen=True)
class RolloutSample:
    """One prompt's group of completions, for inspection (bounded: a few groups per step)."""

    prompt: str
    answer: str | None
    completions: list[CompletionSample] = field(default_factory=list)


class Callbacks:
    """No-op base class; subclass and override."""

    #: True when this receiver of :meth:`on_checkpoint` applies the job's checkpoint retention
    #: (``JobSpec.checkpoint``) itself, as the service's worker does to keep its records in step
    #: with the disk; the trainer then deletes no checkpoint. False: the trainer prunes its
    #: output folder by the same rule after each save.
    applies_retention: bool = False

    def on_start(self, info: RunInfo) -> None:
        """Called once, after models and the engine are loaded, before the first step."""

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        """Called after the update of ``step`` (1-based) with that step's metrics."""

    def on_event(
        self, kind: str, message: str, level: str = "info", data: dict[str, object] | None = None
    ) -> None:
        """Something worth a line in the job's log (level: "info", "warning" or "error")."""

    def on_samples(self, step: int, samples: list[RolloutSample]) -> None:
        """A few rollout groups of ``step``, called before :meth:`on_step`."""

    def on_checkpoint(self, step: int, path: Path) -> None:
        """A checkpoint of ``step`` is complete at ``path`` (called after the atomic rename)."""

    def should_stop(self) -> bool:
        """Polled between steps and between rollout rounds; True stops the run after saving a
        checkpoint of the last completed step."""
        return False


class CallbackList(Callbacks):
    """Fan every hook out to several callbacks; stop when any of them asks to."""

    def __init__(self, *callbacks: Callbacks) -> None:
        self.callbacks = list(callbacks)

    @property
    def applies_retention(self) -> bool:  # type: ignore[override]
        return any(cb.applies_retention for cb in self.callbacks)

    def on_start(self, info: RunInfo) -> None:
        for cb in self.callbacks:
            cb.on_start(info)

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        for cb in self.callbacks:
            cb.on_step(step, metrics)

    def on_event(
        self, kind: str, message: str, level: str = "info", data: dict[str, object] | None = None
    ) -> None:
        for cb in self.callbacks:
            cb.on_event(kind, message, level, data)

    def on_samples(self, step: int, samples: list[RolloutSample]) -> None:
        for cb in self.callbacks:
            cb.on_samples(step, samples)

    def on_checkpoint(self, step: int, path: Path) -> None:
        for cb in self.callbacks:
            cb.on_checkpoint(step, path)

    def should_stop(self) -> bool:
        # Ask every callback (no short-circuit) so each sees the poll.
        answers = [cb.should_stop() for cb in self.callbacks]
        return any(answers)


def _is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (a closed or odd stream is not)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):
        return False


def step_fields(metrics: dict[str, float]) -> dict[str, str]:
    """What the console shows of a step, by name, for both the bar's postfix and the line:
    reward, ``kl`` (when the job has one), ``staleness`` (an async run's
    ``async/staleness_mean``), ``eval`` (a step that evaluated), an agent job's ``turns``,
    ``tools`` and ``tool_err`` per episode, then ``s/step``. A missing value is nan."""
    nan = float("nan")
    fields = {"reward": f"{metrics.get('reward/mean', nan):.3f}"}
    if "kl" in metrics:
        fields["kl"] = f"{metrics['kl']:.4f}"
    if "async/staleness_mean" in metrics:
        fields["staleness"] = f"{metrics['async/staleness_mean']:.2f}"
    if "eval/accuracy" in metrics:
        fields["eval"] = f"{metrics['eval/accuracy']:.3f}"
    if "episode/turns" in metrics:  # an agent job: turns and tool calls per episode
        fields["turns"] = f"{metrics['episode/turns']:.2f}"
        fields["tools"] = f"{metrics.get('tools/calls', 0.0):.2f}"
        fields["tool_err"] = f"{metrics.get('tools/errors', 0.0):.2f}"
    fields["s/step"] = f"{metrics.get('time/step', nan):.1f}"
    return fields


def step_line(step: int, total: int, metrics: dict[str, float]) -> str:
    """One step as one line: ``step 3/20 reward 0.250 loss 0.0123 ... s/step 1.2`` (the fields
    of :func:`step_fields`, ``loss`` after the reward). ``loss`` is ``loss/policy + loss/kl``
    (the update's objective)."""
    loss = metrics.get("loss/policy", float("nan")) + metrics.get("loss/kl", 0.0)
    fields = step_fields(metrics)
    parts = [f"step {step}/{total}", f"reward {fields.pop('reward')}", f"loss {loss:.4f}"]
    parts.extend(f"{name} {value}" for name, value in fields.items())
    return " ".join(parts)


class ConsoleCallbacks(Callbacks):
    """A tqdm progress bar (step, reward, kl, seconds per step) and event lines, for the CLI.

    When the stream is not a terminal (a log file, a pipe) or ``disable`` is set
    (``--no-progress``), there is no bar: each step prints one line instead
    (:func:`step_line`).

    ``request_stop()`` (e.g. from a SIGINT handler) makes the run stop after the current step
    with a checkpoint.
    """

    def __init__(self, stream: TextIO | None = None, *, disable: bool = False) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._lines = disable or not _is_terminal(self._stream)
        self._bar: tqdm[None] | None = None
        self._total = 0
        self._stop = False

    def request_stop(self) -> None:
        self._stop = True

    def should_stop(self) -> bool:
        return self._stop

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self._stream)
        else:
            print(line, file=self._stream, flush=True)

    def on_start(self, info: RunInfo) -> None:
        resumed = f", resumed from {info.resumed_from}" if info.resumed_from else ""
        model = info.model_path.name if info.model_path is not None else "the given model"
        self._write(
            f"training {model} for {info.total_steps} steps on {info.device} "
            f"({info.engine} rollouts{resumed}); output in {info.output_dir}"
        )
        self._total = info.total_steps
        if self._lines:
            return
        self._bar = tqdm(
            total=info.total_steps,
            initial=info.start_step,
            desc="grpo",
            unit="step",
            file=self._stream,
            dynamic_ncols=True,
        )

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if self._lines:
            self._write(step_line(step, self._total, metrics))
            return
        if self._bar is None:
            return
        postfix = {"step": str(step), **step_fields(metrics)}
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)

    def on_event(
        self, kind: str, message: str, level: str = "info", data: dict[str, object] | None = None
    ) -> None:
        if level != "info" or kind in {"resume", "stop", "eval", "error"}:
            self._write(f"[{level}] {kind}: {message}")

    def on_checkpoint(self, step: int, path: Path) -> None:
        self._write(f"checkpoint of step {step}: {path}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


METRICS_FILE = "metrics.jsonl"


def _json_value(value: object) -> object:
    """A metric as JSON: a non-finite float as null (JSON has no NaN or Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsFile(Callbacks):
    """``metrics.jsonl`` in the run's output folder (``grpo train`` writes it): one JSON object
    per step, ``{"step": n, ...}`` with every metric :meth:`Callbacks.on_step` got for it
    (non-finite values as null), appended and flushed as each step ends.

    A fresh run (start step 0) starts the file empty. A resumed run keeps the lines of the steps
    up to the checkpoint it resumed from and drops the later ones (steps the resumed run does
    again), so the file holds each step once."""

    def __init__(self, path: Path | None = None) -> None:
        self._given = path
        self.path: Path | None = path

    def on_start(self, info: RunInfo) -> None:
        path = self._given or info.output_dir / METRICS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = _lines_up_to(path, info.start_step) if info.start_step > 0 else []
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(kept), encoding="utf-8")
        os.replace(partial, path)
        self.path = path

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if self.path is None:
            raise RuntimeError("MetricsFile.on_step before on_start: no output folder yet")
        record = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, allow_nan=False) + "\n")


def _lines_up_to(path: Path, last_step: int) -> list[str]:
    """The lines of ``path`` whose step is at most ``last_step`` (none if there is no file);
    a line that is not a step's JSON (one cut by a crash) is left out."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    kept = []
    for line in text.splitlines():
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and step <= last_step:
            kept.append(line + "\n")
    return kept
