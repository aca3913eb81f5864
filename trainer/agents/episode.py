"""One episode, token in and token out: the tokens the engine sampled are kept as it sampled
them, everything else is the chat template's token delta, checked.

An episode's tokens are one or more :class:`Segment` s, each a prompt and a completion that
interleaves sampled assistant turns (loss mask 1, the engine's log-probs) with injected turns
(tool results, environment messages: loss mask 0, log-prob 0.0). After a turn the driver
renders the whole conversation again and takes the suffix after the tokens so far
(:func:`token_delta`) only where the render starts with exactly those tokens. Where it does
not (template drift: the template re-renders an earlier turn differently, Llama-3's ``| trim``
or Qwen3's think-block stripping, or the sampled tokens are not the tokenizer's own encoding of
their text), nothing is re-tokenised, and ``episode.on_template_drift`` decides:

- ``continue`` (the default): the episode goes on from the tokens it has; from then on each
  turn's new messages are appended as the template writes them after an assistant turn
  (:meth:`~trainer.agents.chat.ChatFormat.continuation`), never re-rendering the turns before.
  Every turn stays in the one segment, so every sampled token trains. Where the template shows
  no continuation, the episode splits instead;
- ``split``: a new segment starts whose prompt is the new render; the training sample is the
  first segment, the later ones are left out (counted);
- ``drop``: the episode ends unused.

Each drift is counted (``episode/template_drift``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "END_REASONS",
    "EndReason",
    "Episode",
    "Segment",
    "token_delta",
]

EndReason = Literal[
    "done",  # the environment said so, or the model answered without calling a tool
    "max_turns",
    "max_tool_calls",
    "max_episode_tokens",
    "truncated",  # a turn hit max_new_tokens before its end token
    "malformed_call",
    "error",  # the environment failed (a tool's failure is a result the model reads)
    "template_drift",  # only with on_template_drift "drop"
]
END_REASONS: tuple[EndReason, ...] = (
    "done",
    "max_turns",
    "max_tool_calls",
    "max_episode_tokens",
    "truncated",
    "malformed_call",
    "error",
    "template_drift",
)


def token_delta(previous: Sequence[int], rendered: Sequence[int]) -> tuple[list[int], int | None]:
    """``(rendered[len(previous):], None)`` when ``rendered`` starts with exactly ``previous``;
    else ``([], i)`` with ``i`` the first position where they differ (``len(rendered)`` when the
    render is a strict prefix of ``previous``)."""
    n = len(previous)
    if len(rendered) >= n and list(rendered[:n]) == list(previous):
        return list(rendered[n:]), None
    for i, (a, b) in enumerate(zip(previous, rendered, strict=False)):
        if a != b:
            return [], i
    return [], min(n, len(rendered))


@dataclass
class Segment:
    """A prompt and a completion; ``logprobs`` and ``loss_mask`` have one value per completion
    token (1 and the engine's log-prob where sampled, 0 and 0.0 where injected)."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        """What the model reads next: the prompt and the completion so far."""
        return self.prompt_ids + self.completion_ids

    @property
    def sampled(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Episode:
    """One episode of one dataset row (see the module docstring). The driver
    (:mod:`trainer.agents.driver`) moves it turn by turn."""

    row: int  # its index in the batch
    item: Mapping[str, Any]
    messages: list[dict[str, Any]]  # the conversation, as rendered
    segments: list[Segment]
    turns: int = 0
    # messages[:turn_end] ends with the latest assistant turn; what follows is not in tokens yet
    turn_end: int = 0
    appending: bool = False  # after a drift with "continue": new messages are appended
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # name, arguments, result
    malformed: int = 0
    tool_errors: int = 0
    drifts: int = 0
    injected_tokens: int = 0
    env_reward: float | None = None
    end_reason: EndReason | None = None
    end_detail: str | None = None  # why, where the reason alone does not say (an error's text)
    dropped: bool = False  # not trained (template drift with "drop")
    last_text: str = ""  # the last assistant turn's content, tool calls removed
    episode_id: str = ""  # what the environment knows it by
    # The policy version of each sampled turn, where the engine reports one (an async run's
    # rollout server); its samples count as old as their oldest turn.
    turn_versions: list[int] = field(default_factory=list)
    # What happened after the row's own conversation, one entry per message, written by the
    # driver: ``source`` ("model", "tool" or "environment"), ``role`` and ``content``; a model
    # turn adds ``tool_calls`` (name, arguments) and ``malformed`` (reasons), a tool result its
    # ``name`` and ``error``. The rollout viewer's transcript is built from it
    # (:func:`trainer.agents.samples.sample_transcript`).
    log: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        row: int,
        item: Mapping[str, Any],
        messages: list[dict[str, Any]],
        prompt: list[int],
        *,
        episode_id: str = "",
    ) -> Episode:
        segments = [Segment(list(prompt))]
        return cls(row, item, messages, segments, episode_id=episode_id or f"ep-{row}")

    @property
    def live(self) -> bool:
        return self.end_reason is None

    @property
    def context(self) -> list[int]:
        return self.segments[-1].context

    def end(self, reason: EndReason, detail: str | None = None) -> None:
        if self.end_reason is None:
            self.end_reason = reason
            self.end_detail = detail

    def add_turn(self, token_ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        """Append an assistant turn exactly as sampled (mask 1)."""
        seg = self.segments[-1]
        lps = list(logprobs) if logprobs is not None else [0.0] * len(token_ids)
        if len(lps) != len(token_ids):
            raise ValueError(f"{len(lps)} logprobs for {len(token_ids)} sampled tokens")
        seg.completion_ids.extend(token_ids)
        seg.logprobs.extend(lps)
        seg.loss_mask.extend([1] * len(token_ids))
        self.turns += 1

    def inject(self, tokens: Sequence[int]) -> None:
        """Append injected tokens (tool results, environment messages, the next generation
        prompt) to the segment: mask 0, log-prob 0.0."""
        seg = self.segments[-1]
        seg.completion_ids.extend(tokens)
        seg.logprobs.extend([0.0] * len(tokens))
        seg.loss_mask.extend([0] * len(tokens))
        self.injected_tokens += len(tokens)

    def split(self, rendered: Sequence[int]) -> None:
        """Start a new segment whose prompt is ``rendered``."""
        self.segments.append(Segment(list(rendered)))
        self.appending = False  # the new segment is the render: it can be compared again

    def drop(self, detail: str) -> None:
        """End the episode unused (template drift with ``drop``)."""
        self.dropped = True
        self.end("template_drift", detail)

    def trained_segments(self) -> list[Segment]:
        """The segments that train: those with a sampled token, none of a dropped episode."""
        if self.dropped:
            return []
        return [s for s in self.segments if s.sampled > 0]
