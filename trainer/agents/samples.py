"""Finished episodes as what the rest of the trainer takes: training samples (a prompt and a
:class:`~trainer.rollout.base.Completion` whose ``loss_mask`` marks the sampled tokens, one per
trained segment), the transcript graders read, and the step's episode metrics.

What the rollout viewer shows of an episode is :func:`sample_transcript`: its turns after the
row's own conversation (which the viewer shows as the group's prompt), bounded (see there).

Metric names (per step, from :func:`episode_metrics`):

- ``episode/turns``: mean assistant turns per episode;
- ``tools/calls``: mean tool calls per episode; ``tools/errors``: calls that failed (raised,
  overran, unknown tool, endpoint error), per episode; ``tools/malformed``: calls that could not
  be read, per episode;
- ``episode/end/<reason>``: the share of episodes that ended for each reason of
  :data:`~trainer.agents.episode.END_REASONS` (all reported, 0 included);
- ``episode/masked_token_frac``: injected tokens over all completion tokens (mask 0 share);
- ``episode/template_drift``: drifts per episode; ``episode/dropped_frac``: episodes not trained;
- ``episode/samples_per_episode``: trained segments per episode (above 1 after splits);
- ``episode/env_reward/mean``: the environment's reward, over episodes that got one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from trainer.agents.episode import END_REASONS, Episode
from trainer.agents.parsing import MAX_CALLS_PER_TURN
from trainer.rollout.base import Completion, FinishReason

__all__ = [
    "MAX_LABEL_CHARS",
    "MAX_REASONS",
    "MAX_TRANSCRIPT_CHARS",
    "MAX_TRANSCRIPT_TURNS",
    "MAX_TURN_CHARS",
    "episode_metrics",
    "episode_samples",
    "sample_transcript",
    "transcript",
]

_CUT = ("truncated", "max_episode_tokens")

# The bounds of one sample's transcript, whatever the episode holds. A step hands
# ``sample_groups`` groups (the worker's default: 2) of ``group_size`` episodes (default 8) to
# the rollout viewer, so a default step's transcripts hold at most 16 x 4,000 characters of
# text, plus the keys of at most 16 turns (and 16 calls or reasons in a turn) each.
MAX_TRANSCRIPT_TURNS = 16  # turns shown; the later ones are counted in ``turns_left_out``
MAX_TURN_CHARS = 1_000  # of a turn's content, and of each call's arguments (as JSON)
MAX_LABEL_CHARS = 200  # of a tool's name, its error and a malformed call's reason
MAX_TRANSCRIPT_CHARS = 4_000  # of every string above together; once spent, turns left out
MAX_REASONS = MAX_CALLS_PER_TURN  # malformed-call reasons shown of a turn (the parser's calls)


class _Budget:
    """What is left of :data:`MAX_TRANSCRIPT_CHARS`; ``take`` cuts a string to what fits."""

    def __init__(self, chars: int) -> None:
        self.left = chars

    def take(self, text: str, cap: int) -> tuple[str, int]:
        """``text`` cut to ``cap`` and to what is left, and how many characters were cut."""
        keep = min(len(text), cap, self.left)
        self.left -= keep
        return text[:keep], len(text) - keep

    def label(self, text: str | None) -> str | None:
        return None if text is None else self.take(text, MAX_LABEL_CHARS)[0]


def episode_samples(episode: Episode) -> list[tuple[list[int], Completion]]:
    """``(prompt_ids, completion)`` per trained segment. Each completion's text is the episode's
    final answer (what graders grade); its finish reason is "length" when the episode was cut
    by a token limit (so ``mask_truncated`` and overlong shaping see it)."""
    reason: FinishReason = "length" if episode.end_reason in _CUT else "stop"
    return [
        (
            list(seg.prompt_ids),
            Completion(
                token_ids=list(seg.completion_ids),
                logprobs=list(seg.logprobs),
                text=episode.last_text,
                finish_reason=reason,
                loss_mask=list(seg.loss_mask),
                policy_version=min(episode.turn_versions, default=None),
            ),
        )
        for seg in episode.trained_segments()
    ]


def transcript(episode: Episode) -> dict[str, Any]:
    """What graders read beyond ``output_text``: ``messages`` (the conversation) and
    ``tool_calls`` (name, arguments and result of each call), and why the episode ended."""
    return {
        "output_text": episode.last_text,
        "messages": [dict(m) for m in episode.messages],
        "tool_calls": [dict(c) for c in episode.tool_calls],
        "end_reason": episode.end_reason,
        "end_detail": episode.end_detail,
    }


def _shown_turn(entry: dict[str, Any], budget: _Budget) -> dict[str, Any]:
    """One :attr:`Episode.log` entry as the transcript shows it (every key present)."""
    content, cut = budget.take(str(entry.get("content", "")), MAX_TURN_CHARS)
    calls = []
    for call in entry.get("tool_calls", ()):
        arguments = json.dumps(call["arguments"], ensure_ascii=False, default=str)
        name = budget.label(str(call["name"]))
        shown, args_cut = budget.take(arguments, MAX_TURN_CHARS)
        calls.append({"name": name, "arguments": shown, "arguments_cut": args_cut})
    return {
        "source": entry["source"],
        "role": entry["role"],
        "content": content,
        "content_cut": cut,
        "name": budget.label(entry.get("name")),
        "tool_calls": calls,
        "malformed": [budget.label(str(r)) for r in entry.get("malformed", ())[:MAX_REASONS]],
        "error": budget.label(entry.get("error")),
    }


def sample_transcript(episode: Episode) -> dict[str, Any]:
    """What the rollout viewer shows of ``episode`` (JSON, as the samples API returns it):
    ``end_reason``, ``end_detail`` (why, where the reason alone does not say: the environment's
    error, the unreadable call, the drift; else null), ``turns`` and ``turns_left_out``.

    ``turns`` are the messages after the row's own conversation, in order, each with
    ``source``: ``model`` (an assistant turn: its text without its well-formed tool calls, or
    as written when a call in it could not be read; ``tool_calls`` as ``{name, arguments
    (JSON text), arguments_cut}``; ``malformed``: why calls could not be read), ``tool`` (a
    call's result: ``name``, ``content``, ``error`` when the call failed) or ``environment``
    (a message of the environment's reset or step). Every turn has every key (``name`` and
    ``error`` null where they do not apply).

    Bounded: at most :data:`MAX_TRANSCRIPT_TURNS` turns; a content and a call's arguments cut
    to :data:`MAX_TURN_CHARS` (``content_cut``/``arguments_cut``: the characters left out),
    names, errors, reasons and ``end_detail`` to :data:`MAX_LABEL_CHARS` (at most
    :data:`MAX_REASONS` reasons a turn); all of it but ``end_detail`` together to
    :data:`MAX_TRANSCRIPT_CHARS`, after which the rest of the turns are left out.
    ``turns_left_out`` counts the turns not shown."""
    detail = episode.end_detail
    budget = _Budget(MAX_TRANSCRIPT_CHARS)
    turns: list[dict[str, Any]] = []
    for entry in episode.log:
        if len(turns) == MAX_TRANSCRIPT_TURNS or budget.left == 0:
            break
        turns.append(_shown_turn(entry, budget))
    return {
        "end_reason": episode.end_reason,
        "end_detail": None if detail is None else detail[:MAX_LABEL_CHARS],
        "turns": turns,
        "turns_left_out": len(episode.log) - len(turns),
    }


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """The step's episode metrics (names in the module docstring); empty without episodes."""
    n = len(episodes)
    if n == 0:
        return {}
    completion = sum(len(s.completion_ids) for e in episodes for s in e.segments)
    injected = sum(len(s.loss_mask) - s.sampled for e in episodes for s in e.segments)
    out = {
        "episode/turns": sum(e.turns for e in episodes) / n,
        "tools/calls": sum(len(e.tool_calls) for e in episodes) / n,
        "tools/errors": sum(e.tool_errors for e in episodes) / n,
        "tools/malformed": sum(e.malformed for e in episodes) / n,
        "episode/masked_token_frac": injected / completion if completion else 0.0,
        "episode/template_drift": sum(e.drifts for e in episodes) / n,
        "episode/dropped_frac": sum(e.dropped for e in episodes) / n,
        "episode/samples_per_episode": sum(len(e.trained_segments()) for e in episodes) / n,
    }
    for reason in END_REASONS:
        out[f"episode/end/{reason}"] = sum(e.end_reason == reason for e in episodes) / n
    rewards = [e.env_reward for e in episodes if e.env_reward is not None]
    if rewards:
        out["episode/env_reward/mean"] = sum(rewards) / len(rewards)
    return out
