"""An agent job's rollout: every sample of a group is a multi-turn episode
(:mod:`trainer.agents`) instead of one completion.

- Each row's conversation (the dataset's system prompt, then its messages or its prompt as a
  user turn) starts ``G`` episodes; one :func:`~trainer.agents.run_episodes` call runs all of a
  share's episodes, every turn of every live episode in one engine ``generate`` call.
- An episode is ONE training sample of its group (the group's advantages are over its ``G``
  episodes): its first trained segment, with the episode's loss mask (tool results and
  environment turns: 0). With ``episode.on_template_drift: continue`` (the default) a drift
  leaves the episode in one segment, so all of it trains; one that a drift split (``split``, or
  a template that shows no continuation) trains only that first segment here (the rest are
  counted in ``episode/segments_left_out``); an episode with nothing to train (dropped for
  drift, or ended before its first turn) is a sample whose loss mask is all 0: its reward
  still counts in its group's baseline, it moves no weight. ``episode/sampled_left_out_frac``
  is the share of the step's sampled tokens that train in no sample.
- Episodes end at the model's context when ``episode.max_episode_tokens`` is longer (the
  engine cannot hold more; reason ``max_episode_tokens``): the run says so in a warning event
  when it starts (:func:`episode_token_limit`).
- Graders grade the episode's final answer as ``sample.output_text`` with the transcript as
  ``sample.messages`` and ``sample.tool_calls`` (:class:`~grading.templates.EpisodeAnswer`).
- The rollout viewer's samples carry each episode's turns, bounded
  (:func:`~trainer.agents.sample_transcript`, ``CompletionSample.transcript``).
- The environment's reward (the sum of its steps' rewards; 0 when it gave none) is a reward
  component named ``environment``, weighted by ``environment.weight`` and added to the graders'
  total like a grader's (metric ``reward/environment/mean``).
- The step's metrics gain :func:`~trainer.agents.episode_metrics` (``episode/*``, ``tools/*``)
  and, where the engine counts its prefill (vLLM), ``episode/prefill_cached_frac``: the share
  of the prompt tokens of the rollout's generate calls read from its prefix cache (each turn
  after the first re-reads the conversation so far from it).

What this trainer does not run yet is refused by :func:`agent_refusal` (``train()`` fails the
job with that reason): http tools and http environments when ``train()`` was given no client
of the operator's endpoints (the worker gives them: ``worker.agents``), and jobs of several
devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn
from transformers import PreTrainedTokenizerBase

from grading.templates import EpisodeAnswer
from jobspec import (
    DatasetSpec,
    EpisodeSpec,
    GRPOSpec,
    HttpEnvironment,
    HttpToolImplementation,
    JobSpec,
    PythonEnvironment,
)
from trainer.agents import (
    ChatFormat,
    Environment,
    Episode,
    HttpTools,
    SandboxEnvironment,
    Toolbox,
    TurnSettings,
    chat_format,
    episode_metrics,
    episode_samples,
    run_episodes,
    sample_transcript,
    start_episodes,
)
from trainer.data.dataset import Example
from trainer.data.dataset import conversation as row_conversation
from trainer.errors import TrainerError
from trainer.rollout.base import (
    Completion,
    FinishReason,
    PrefillCounts,
    RolloutEngine,
    model_context_tokens,
)
from trainer.rollout.stop_tokens import stop_token_ids
from trainer.run.setup import Given, RunSetup
from trainer.scoring.sampling import Rolled

__all__ = [
    "ENVIRONMENT_REWARD",
    "AgentRollout",
    "agent_refusal",
    "agent_rollout",
    "episode_token_limit",
    "refuse_unrunnable",
    "training_sample",
]

ENVIRONMENT_REWARD = "environment"  # the reward component's name (reward/environment/mean)


def agent_refusal(config: JobSpec, *, http_tools: bool, http_environment: bool) -> str | None:
    """Why this trainer cannot run ``config``'s episodes (None: it can)."""
    if config.resources.devices > 1:
        return (
            "tools and environments run on one device only for now "
            f"(resources.devices is {config.resources.devices})"
        )
    if not config.dataset.use_chat_template:
        return "tools and environments need the chat template (dataset.use_chat_template)"
    http = [
        t.function.name
        for t in config.tools
        if isinstance(t.implementation, HttpToolImplementation)
    ]
    if http and not http_tools:
        return f"http tools are not available to this trainer (tools {', '.join(http)})"
    if isinstance(config.environment, HttpEnvironment) and not http_environment:
        return "http environments are not available to this trainer"
    return None


def refuse_unrunnable(
    config: JobSpec, *, http_tools: HttpTools | None, http_environment: Environment | None
) -> None:
    """TrainerError (reason ``agents_not_supported``) when :func:`agent_refusal` has a reason."""
    refusal = agent_refusal(
        config, http_tools=http_tools is not None, http_environment=http_environment is not None
    )
    if refusal is not None:
        raise TrainerError(refusal, reason="agents_not_supported")


def episode_token_limit(
    config: JobSpec, model: nn.Module, tokenizer: PreTrainedTokenizerBase
) -> tuple[int, str | None]:
    """The tokens an episode may hold (``episode.max_episode_tokens``, or the model's context
    when that is shorter) and, when it is shorter, the warning that says so."""
    asked = config.episode.max_episode_tokens
    context = model_context_tokens(getattr(model, "config", None), tokenizer)
    if context is None or context >= asked:
        return asked, None
    return context, (
        f"episode.max_episode_tokens is {asked}, but the model's context is {context} tokens: "
        f"episodes end at {context} tokens (end reason max_episode_tokens)"
    )


def agent_rollout(config: JobSpec, setup: RunSetup, given: Given) -> AgentRollout | None:
    """The run's episode rollout (None for a job without tools or an environment)."""
    if not config.is_agentic:
        return None
    limit, warning = episode_token_limit(config, setup.engine_model, setup.tokenizer)
    if warning is not None:
        setup.callbacks.on_event(
            "config",
            warning,
            level="warning",
            data={"field": "episode.max_episode_tokens", "limit": limit},
        )
    return AgentRollout(
        config,
        setup.tokenizer,
        model=setup.engine_model,
        model_path=setup.model_path,
        http_tools=given.http_tools,
        http_environment=given.http_environment,
    )


def conversation(example: Example, dataset: DatasetSpec) -> list[dict[str, Any]]:
    """The row's conversation as its prompt was formatted (``trainer.data.dataset``)."""
    prompt = example.messages if example.messages is not None else (example.prompt or "")
    few_shot = [m.model_dump() for m in dataset.few_shot]
    # A fresh list of fresh dicts: each episode appends to and edits its own conversation.
    return row_conversation(prompt, system_prompt=dataset.system_prompt, few_shot=few_shot)


def _left_out_metrics(
    episodes: Sequence[Episode], trained: Sequence[Completion], segments_left_out: Sequence[int]
) -> dict[str, float]:
    """``episode/segments_left_out`` (per episode) and ``episode/sampled_left_out_frac``: the
    share of the sampled tokens that ``trained`` (each episode's training sample) leaves out."""
    sampled = sum(s.sampled for e in episodes for s in e.segments)
    kept = sum(sum(c.loss_mask or ()) for c in trained)
    return {
        "episode/segments_left_out": sum(segments_left_out) / max(1, len(episodes)),
        "episode/sampled_left_out_frac": (sampled - kept) / sampled if sampled else 0.0,
    }


def training_sample(episode: Episode) -> tuple[list[int], Completion, int]:
    """The episode's one training sample (see the module docstring) and how many of its trained
    segments are left out."""
    samples = episode_samples(episode)
    if samples:
        prompt, completion = samples[0]
        return prompt, completion, len(samples) - 1
    seg = episode.segments[0]
    ids = list(seg.completion_ids) or [seg.prompt_ids[-1]]
    logprobs = list(seg.logprobs) if seg.completion_ids else [0.0]
    reason: FinishReason = (
        "length" if episode.end_reason in ("truncated", "max_episode_tokens") else "stop"
    )
    return (
        list(seg.prompt_ids),
        Completion(ids, logprobs, episode.last_text, reason, loss_mask=[0] * len(ids)),
        0,
    )


class AgentRollout:
    """A :class:`~trainer.scoring.sampling.Rollout` of episodes (see the module docstring)."""

    def __init__(
        self,
        config: JobSpec,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model: nn.Module | None = None,
        model_path: Path | None = None,
        http_tools: HttpTools | None = None,
        http_environment: Environment | None = None,
    ) -> None:
        budgets = config.episode
        self.config = config
        self.toolbox = (
            Toolbox(config.tools, timeout_s=budgets.tool_timeout_s, http=http_tools)
            if config.tools
            else None
        )
        self.environment: Environment | None = http_environment
        self.weight = 0.0
        env = config.environment
        if env is not None:
            self.weight = env.weight
        if isinstance(env, PythonEnvironment):
            self.environment = SandboxEnvironment(
                env.source, env.class_name, timeout_s=budgets.tool_timeout_s, settings=None
            )
        self.fmt: ChatFormat = chat_format(
            tokenizer, self.toolbox.schemas() if self.toolbox else ()
        )
        self.stop_ids = tuple(stop_token_ids(tokenizer, model=model, model_path=model_path))
        limit = config.episode.max_episode_tokens
        if model is not None:
            limit = episode_token_limit(config, model, tokenizer)[0]
        self.budgets = config.episode.model_copy(update={"max_episode_tokens": limit})

    @property
    def extra_names(self) -> list[str]:
        return [ENVIRONMENT_REWARD] if self.config.environment is not None else []

    def sample(
        self,
        engine: RolloutEngine,
        prompt_ids: Sequence[list[int]],
        examples: Sequence[Example],
        group_size: int,
        spec: GRPOSpec,
        *,
        seed: int,
        greedy: bool = False,
    ) -> Rolled:
        rows = [e for e in examples for _ in range(group_size)]
        episodes = start_episodes(
            self.fmt,
            [conversation(e, self.config.dataset) for e in rows],
            [e.grading_item for e in rows],
            self.environment,
        )
        settings = TurnSettings(
            max_new_tokens=spec.max_new_tokens,
            temperature=spec.temperature,
            seed=seed,
            budgets=self._budgets(engine),
            stop_token_ids=self.stop_ids,
            greedy=greedy,
        )
        prefill = getattr(engine, "prefill", None)  # an engine that counts them (vLLM)
        before = dataclasses.replace(prefill) if isinstance(prefill, PrefillCounts) else None
        run_episodes(
            engine, self.fmt, episodes, settings, toolbox=self.toolbox, environment=self.environment
        )
        samples = [training_sample(e) for e in episodes]
        metrics = episode_metrics(episodes)
        metrics.update(
            _left_out_metrics(episodes, [s[1] for s in samples], [s[2] for s in samples])
        )
        if isinstance(prefill, PrefillCounts) and before is not None:
            metrics["episode/prefill_cached_frac"] = prefill.cached_share_since(before)
        g = group_size
        rolled = Rolled(
            completions=[[s[1] for s in samples[i : i + g]] for i in range(0, len(samples), g)],
            prompts=[[s[0] for s in samples[i : i + g]] for i in range(0, len(samples), g)],
            texts=[EpisodeAnswer(e.last_text, e.messages, e.tool_calls) for e in episodes],
            transcripts=[sample_transcript(e) for e in episodes],
            metrics=[(len(episodes), metrics)],
        )
        if self.config.environment is not None:
            rewards = [e.env_reward or 0.0 for e in episodes]
            rolled.extra_rewards[ENVIRONMENT_REWARD] = (self.weight, rewards)
        return rolled

    def _budgets(self, engine: RolloutEngine) -> EpisodeSpec:
        """The episode budgets, the token limit within the engine's context too (a caller's
        engine may hold less than the model)."""
        engine_limit = getattr(engine, "max_model_len", None)
        if isinstance(engine_limit, int) and engine_limit < self.budgets.max_episode_tokens:
            return self.budgets.model_copy(update={"max_episode_tokens": engine_limit})
        return self.budgets

    def close(self) -> None:
        if self.toolbox is not None:
            self.toolbox.close()
        if self.environment is not None:
            self.environment.close()
