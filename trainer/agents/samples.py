"""Finished episodes as what the rest of the trainer takes: training samples (a prompt and a
:class:`~trainer.rollout.base.Completion` whose ``loss_mask`` marks the sampled tokens, one per
trained segment), the transcript graders read, and the step's episode metrics.

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

from collections.abc import Sequence
from typing import Any

from trainer.agents.episode import END_REASONS, Episode
from trainer.rollout.base import Completion, FinishReason

__all__ = ["episode_metrics", "episode_samples", "transcript"]

_CUT = ("truncated", "max_episode_tokens")


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
