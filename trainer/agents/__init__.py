"""Agents: multi-turn episodes with tools and environments, trained only on the tokens the
model sampled (docs/trainer.md, "Agents: multi-turn episodes").

Owns (token ids and messages, no tensor math):

- ``chat``: how tools reach the model through its chat template (``tools=`` where the template
  renders them, else the default tool prompt in the system turn) and how tool results come
  back (a ``tool`` turn, or a prefixed user turn);
- ``parsing``: tool calls out of an assistant turn, by model family (Hermes/Qwen
  ``<tool_call>``, also the default); a malformed call is a counted event, never an exception;
- ``episode``: token-in/token-out episodes: sampled turns kept as sampled (loss mask 1),
  injected turns as the template's checked token delta (mask 0), template drift continued,
  split or dropped and counted;
- ``outside``: what tools and environments write, as the model reads it: lone surrogates
  replaced, special tokens tokenised as plain text (no forged turns);
- ``driver``: the rollout, one engine ``generate`` per turn for all live episodes (the
  engine's prefix cache kept across the turns), tools and the environment between turns,
  budgets and end reasons, random episode ids;
- ``tools``: python tools in the grader sandbox, http tools through :class:`HttpTools`;
- ``environment``: the :class:`Environment` protocol (reset/step, batched), python classes in
  the sandbox (:class:`SandboxEnvironment`);
- ``samples``: episodes as training samples (``Completion.loss_mask``), grader transcripts, the
  rollout viewer's bounded transcript and the ``episode/*``/``tools/*`` metrics.

Uses: ``jobspec`` (``ToolSpec``, ``EpisodeSpec``), ``trainer.rollout.base``
(``RolloutEngine``, ``Completion``), ``grading.sandbox`` (``SandboxPool`` in call mode) and
``trainer.seeding``. The update side needs nothing from here: ``Completion.loss_mask`` reaches
the loss through ``trainer.update.inputs.pack_groups`` / ``trainer.update.batch.pack_batch``.

Filled in by the worker (not here; ``worker.agents``): :class:`HttpTools` (the operator's tool
endpoints, ``GRPO_TOOL_ENDPOINTS``) and an http :class:`Environment` (POST reset/step with an
episode id), which it passes to ``train()``.
"""

from trainer.agents.chat import ChatFormat, chat_format, default_tool_prompt
from trainer.agents.driver import TurnSettings, new_episode_id, run_episodes, start_episodes
from trainer.agents.environment import Environment, EnvStep, SandboxEnvironment
from trainer.agents.episode import END_REASONS, EndReason, Episode, Segment, token_delta
from trainer.agents.outside import OutsideText, outside
from trainer.agents.parsing import ParsedTurn, ToolCall, parse_hermes, parser_family
from trainer.agents.samples import (
    episode_metrics,
    episode_samples,
    sample_transcript,
    transcript,
)
from trainer.agents.tools import HttpTools, Toolbox, ToolResult, ToolRunner

__all__ = [
    "END_REASONS",
    "ChatFormat",
    "EndReason",
    "EnvStep",
    "Environment",
    "Episode",
    "HttpTools",
    "OutsideText",
    "ParsedTurn",
    "SandboxEnvironment",
    "Segment",
    "ToolCall",
    "ToolResult",
    "ToolRunner",
    "Toolbox",
    "TurnSettings",
    "chat_format",
    "default_tool_prompt",
    "episode_metrics",
    "episode_samples",
    "new_episode_id",
    "outside",
    "parse_hermes",
    "parser_family",
    "run_episodes",
    "sample_transcript",
    "start_episodes",
    "token_delta",
    "transcript",
]
