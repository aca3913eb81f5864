"""The multi-turn rollout: every turn of every live episode of a batch goes through the engine in
ONE generate call (no episode waits on another's tool while the engine idles, and the engine
batches as it does for single-turn rollouts); between turns the turn's tool calls run together
(:class:`~trainer.agents.tools.Toolbox`), then the environment answers the turns that called no
tool (:class:`~trainer.agents.environment.Environment`), then each conversation is rendered
again and its delta injected (:meth:`~trainer.agents.episode.Episode.inject`; on template drift
what ``episode.on_template_drift`` says, :mod:`trainer.agents.episode`).

What ends an episode is recorded (``Episode.end_reason``): ``done`` (the environment said so;
without one, the model answered without a tool call), ``max_turns``, ``max_tool_calls`` (the
turn's calls would exceed it: none of them runs), ``max_episode_tokens`` (the next prompt would
reach it, or a turn was cut at it), ``truncated`` (a turn reached ``max_new_tokens``),
``malformed_call`` (a call that could not be read; the turn's well-formed calls do not run),
``error`` (the environment failed; ``Episode.end_detail`` says how) and ``template_drift``
(dropped, see :mod:`trainer.agents.episode`). An episode's environment reward is the sum of its
steps'.

Episode ids (what an environment keys its state by) are random, 128 bits each: unique across
jobs, attempts, steps and rows, and unguessable, so no environment that serves several jobs can
mix their episodes, nor a tenant address another's.

What tools and environments write is outside text (:mod:`trainer.agents.outside`): cleaned of
lone surrogates and tokenised as plain text. The engine keeps its prefix cache across the
turns of one :func:`run_episodes` (each turn's prompt is the last one's context plus a few
tokens), and starts it empty for the next (:func:`trainer.rollout.base.prefix_cache_kept`).

The engine's context limit must hold ``budgets.max_episode_tokens`` (the caller sizes both):
a prompt longer than the engine takes is the engine's error, not an episode event.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jobspec import EpisodeSpec
from trainer.agents.chat import ChatFormat
from trainer.agents.environment import Environment, EnvStep
from trainer.agents.episode import Episode, token_delta
from trainer.agents.outside import clean_text, outside
from trainer.agents.parsing import ToolCall
from trainer.agents.tools import ToolResult, ToolRunner
from trainer.rollout.base import Completion, RolloutEngine, prefix_cache_kept
from trainer.seeding import derive_seed

__all__ = ["EPISODE_ID_BYTES", "TurnSettings", "new_episode_id", "run_episodes", "start_episodes"]

EPISODE_ID_BYTES = 16


@dataclass(frozen=True)
class TurnSettings:
    """How each turn samples, and the episode budgets."""

    max_new_tokens: int  # of one turn
    temperature: float
    seed: int
    budgets: EpisodeSpec
    stop_token_ids: tuple[int, ...]
    greedy: bool = False


def new_episode_id() -> str:
    """A fresh episode id: :data:`EPISODE_ID_BYTES` random bytes as hex."""
    return secrets.token_hex(EPISODE_ID_BYTES)


def start_episodes(
    fmt: ChatFormat,
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    items: Sequence[Mapping[str, Any]],
    environment: Environment | None,
) -> list[Episode]:
    """One episode per conversation (a row's messages, repeated G times for a group), each with
    a fresh id (:func:`new_episode_id`): the environment's reset messages follow the row's, the
    tool prompt goes in (when the template has no tool support), and the whole is rendered as
    the first prompt."""
    ids = [new_episode_id() for _ in conversations]
    resets = [EnvStep()] * len(conversations)
    if environment is not None:
        resets = environment.reset(ids, items)
    episodes = []
    for i, (conversation, item, reset) in enumerate(zip(conversations, items, resets, strict=True)):
        opening = _outside_messages(reset.messages)
        messages = fmt.initial([*conversation, *opening])
        episode = Episode.start(i, item, messages, fmt.render(messages), episode_id=ids[i])
        episode.log.extend(_environment_entry(m) for m in opening)
        if reset.error is not None:
            episode.end("error", f"the environment's reset failed: {clean_text(reset.error)}")
        episodes.append(episode)
    return episodes


def _outside_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """An environment's messages with their content as outside text."""
    return [{**m, "content": outside(str(m.get("content", "")))} for m in messages]


def _environment_entry(message: Mapping[str, Any]) -> dict[str, Any]:
    """An environment's message as an :attr:`Episode.log` entry."""
    return {
        "source": "environment",
        "role": str(message.get("role", "")),
        "content": str(message.get("content", "")),
    }


def _sample_turn(
    engine: RolloutEngine, live: list[Episode], settings: TurnSettings, turn: int
) -> list[Completion]:
    """One generate call for every live episode; each turn capped by its episode's budget."""
    budget = settings.budgets.max_episode_tokens
    caps = [min(settings.max_new_tokens, budget - len(e.context)) for e in live]
    out = engine.generate(
        [e.context for e in live],
        1,
        max_new_tokens=max(caps),
        temperature=settings.temperature,
        seed=derive_seed(settings.seed, turn),
        greedy=settings.greedy,
    )
    completions = []
    for cap, (completion,) in zip(caps, out, strict=True):
        if len(completion.token_ids) > cap:  # sampled past this episode's own budget: cut
            lps = None if completion.logprobs is None else completion.logprobs[:cap]
            completion = Completion(
                completion.token_ids[:cap], lps, "", "length",
                policy_version=completion.policy_version,
            )  # fmt: skip
        completions.append(completion)
    return completions


def _read_turn(
    episode: Episode, completion: Completion, fmt: ChatFormat, settings: TurnSettings
) -> list[ToolCall]:
    """Record a sampled turn; returns the calls to run (none when the episode ended)."""
    episode.add_turn(completion.token_ids, completion.logprobs)
    if completion.policy_version is not None:
        episode.turn_versions.append(completion.policy_version)
    message = fmt.assistant_message(completion.token_ids, settings.stop_token_ids)
    episode.messages.append(message)
    episode.turn_end = len(episode.messages)
    parsed = fmt.parse(message["content"])
    episode.last_text = parsed.content
    episode.log.append(
        {
            "source": "model",
            "role": "assistant",
            # A turn with a call that could not be read is shown as written.
            "content": message["content"] if parsed.malformed else parsed.content,
            "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in parsed.calls],
            "malformed": list(parsed.malformed),
        }
    )
    episode.malformed += len(parsed.malformed)
    budgets = settings.budgets
    if completion.finish_reason == "length":
        full = len(episode.context) >= budgets.max_episode_tokens
        episode.end("max_episode_tokens" if full else "truncated")
    elif parsed.malformed:
        episode.end("malformed_call", parsed.malformed[0])
    elif parsed.calls and len(episode.tool_calls) + len(parsed.calls) > budgets.max_tool_calls:
        episode.end("max_tool_calls")
    elif parsed.calls and episode.turns >= budgets.max_turns:
        episode.end("max_turns")  # its results could never be read
    return parsed.calls if episode.live else []


def _run_tools(
    calls: list[tuple[Episode, ToolCall]], toolbox: ToolRunner | None, fmt: ChatFormat
) -> None:
    """Run the turn's calls in one batch; each result becomes a message of its episode."""
    if not calls:
        return
    if toolbox is None:  # the model called a tool in a job without tools: an error it reads
        results = [ToolResult("error: no tools are available", error="no tools")] * len(calls)
    else:
        results = toolbox.run([call for _, call in calls])
    for (episode, call), result in zip(calls, results, strict=True):
        content = clean_text(result.content)
        error = None if result.error is None else clean_text(result.error)
        episode.tool_errors += error is not None
        episode.tool_calls.append(
            {"name": call.name, "arguments": call.arguments, "result": content}
        )
        message = fmt.tool_message(call.name, content)
        episode.messages.append(message)
        episode.log.append(
            {
                "source": "tool",
                "role": message["role"],
                "name": call.name,
                "content": content,
                "error": error,
            }
        )


def _step_environment(
    answered: list[Episode], environment: Environment | None, settings: TurnSettings
) -> None:
    """The environment's answer to the turns without a tool call (without one: done)."""
    if not answered:
        return
    if environment is None:
        for episode in answered:
            episode.end("done")
        return
    steps = environment.step([e.episode_id for e in answered], [[e.messages[-1]] for e in answered])
    for episode, step in zip(answered, steps, strict=True):
        if step.reward is not None:
            episode.env_reward = (episode.env_reward or 0.0) + step.reward
        if step.error is not None:
            episode.end("error", f"the environment's step failed: {clean_text(step.error)}")
        elif step.done:
            episode.end("done")
        elif episode.turns >= settings.budgets.max_turns:
            episode.end("max_turns")
        else:
            messages = _outside_messages(step.messages)
            episode.messages.extend(messages)
            episode.log.extend(_environment_entry(m) for m in messages)


def _inject(episode: Episode, fmt: ChatFormat, settings: TurnSettings) -> None:
    """The turn's new messages into the episode's tokens (mask 0): the new render's delta, or
    on template drift what ``on_template_drift`` says (:mod:`trainer.agents.episode`)."""
    policy = settings.budgets.on_template_drift
    if not episode.appending:
        rendered = fmt.render(episode.messages)
        delta, drift_at = token_delta(episode.context, rendered)
        if drift_at is None:
            episode.inject(delta)
            return
        episode.drifts += 1
        if policy == "drop":
            episode.drop(f"the chat template re-rendered the conversation at token {drift_at}")
            return
        if policy == "split":
            episode.split(rendered)
            return
        episode.appending = True
    new = episode.messages[episode.turn_end :]
    continued = fmt.continuation(new, episode.context[-1])
    if continued is None:  # the template shows no continuation: the render starts a segment
        episode.split(fmt.render(episode.messages))
    else:
        episode.inject(continued)


def run_episodes(
    engine: RolloutEngine,
    fmt: ChatFormat,
    episodes: Sequence[Episode],
    settings: TurnSettings,
    *,
    toolbox: ToolRunner | None = None,
    environment: Environment | None = None,
) -> None:
    """Run ``episodes`` (from :func:`start_episodes`) until each has ended (see the module
    docstring); at most ``budgets.max_turns`` generate calls."""
    for episode in episodes:  # a first prompt already over the budget
        if episode.live and len(episode.context) >= settings.budgets.max_episode_tokens:
            episode.end("max_episode_tokens")
    with prefix_cache_kept(engine):
        for turn in range(settings.budgets.max_turns):
            live = [e for e in episodes if e.live]
            if not live:
                return
            _turn(engine, fmt, live, settings, turn, toolbox, environment)
    for episode in episodes:
        episode.end("max_turns")


def _turn(
    engine: RolloutEngine,
    fmt: ChatFormat,
    live: list[Episode],
    settings: TurnSettings,
    turn: int,
    toolbox: ToolRunner | None,
    environment: Environment | None,
) -> None:
    """One turn of the ``live`` episodes: sample, run the calls, step the environment, inject."""
    completions = _sample_turn(engine, live, settings, turn)
    calls: list[tuple[Episode, ToolCall]] = []
    answered: list[Episode] = []
    for episode, completion in zip(live, completions, strict=True):
        turn_calls = _read_turn(episode, completion, fmt, settings)
        calls.extend((episode, call) for call in turn_calls)
        if episode.live and not turn_calls:
            answered.append(episode)
    _run_tools(calls, toolbox, fmt)
    _step_environment(answered, environment, settings)
    for episode in live:
        if not episode.live:
            continue
        _inject(episode, fmt, settings)
        if episode.live and len(episode.context) >= settings.budgets.max_episode_tokens:
            episode.end("max_episode_tokens")
