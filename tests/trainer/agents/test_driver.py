"""The multi-turn driver on SmolLM2's tokenizer with a scripted engine: turns batched across
episodes, tokens kept as sampled, injected turns masked, budgets and malformed calls ending
episodes with their reason, template drift detected and counted."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from jobspec import EpisodeSpec
from tests.agent_jobs import SMOL_END, ScriptedEngine
from trainer.agents import (
    EnvStep,
    ToolCall,
    ToolResult,
    TurnSettings,
    chat_format,
    episode_metrics,
    episode_samples,
    run_episodes,
    start_episodes,
)
from trainer.agents.chat import ChatFormat
from trainer.agents.episode import END_REASONS, Episode

TOOLS = [
    {
        "type": "function",
        "function": {"name": "multiply", "parameters": {"type": "object", "properties": {}}},
    }
]
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'


class Calculator:
    """An in-process ToolRunner that records the size of every batch of calls."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        self.batches.append(len(calls))
        return [ToolResult(str(c.arguments["a"] * c.arguments["b"])) for c in calls]


def calculator_reply(prompt: str) -> str:
    """Call the tool once, then answer; answer at once when the question says so."""
    if "directly" in prompt or "<|im_start|>tool" in prompt:
        return "The answer is 408."
    return CALL


def settings(**budgets: Any) -> TurnSettings:
    end = 2  # <|im_end|> in SmolLM2's vocabulary
    return TurnSettings(
        max_new_tokens=128,
        temperature=1.0,
        seed=0,
        budgets=EpisodeSpec(**budgets),
        stop_token_ids=(end,),
    )


def run(
    tokenizer: PreTrainedTokenizerBase,
    reply: Any,
    questions: Sequence[str],
    *,
    fmt: ChatFormat | None = None,
    environment: Any = None,
    **budgets: Any,
) -> tuple[list[Episode], ScriptedEngine, Calculator]:
    fmt = fmt or chat_format(tokenizer, TOOLS)
    engine = ScriptedEngine(tokenizer, reply)
    tools = Calculator()
    conversations = [[{"role": "user", "content": q}] for q in questions]
    episodes = start_episodes(fmt, conversations, [{}] * len(questions), environment)
    run_episodes(engine, fmt, episodes, settings(**budgets), toolbox=tools, environment=environment)
    return episodes, engine, tools


def test_turns_are_batched_across_episodes_and_tokens_kept_as_sampled(
    smol: PreTrainedTokenizerBase,
) -> None:
    questions = ["12*34?", "Answer directly: 12*34?", "What is 12 times 34?"]
    episodes, engine, tools = run(smol, calculator_reply, questions)
    # One generate call per turn for every live episode, one tool batch per turn.
    assert engine.calls == [3, 2]
    assert tools.batches == [2]
    assert [e.end_reason for e in episodes] == ["done", "done", "done"]
    assert [e.turns for e in episodes] == [2, 1, 2]
    assert episodes[0].tool_calls == [
        {"name": "multiply", "arguments": {"a": 12, "b": 34}, "result": "408"}
    ]
    assert episodes[0].last_text == "The answer is 408."
    end = smol.convert_tokens_to_ids(SMOL_END)
    first = episodes[0]
    assert first.drifts == 0 and len(first.segments) == 1
    seg = first.segments[0]
    # The mask-1 tokens are exactly the engine's samples, turn after turn, with their logprobs.
    sampled = [t for t, m in zip(seg.completion_ids, seg.loss_mask, strict=True) if m]
    assert sampled == engine.sampled[0] + engine.sampled[3]
    assert [lp for lp, m in zip(seg.logprobs, seg.loss_mask, strict=True) if m] == [-0.25] * len(
        sampled
    )
    # Injected: the tool turn and the next generation prompt, as the template renders them.
    injected = smol.decode(
        [t for t, m in zip(seg.completion_ids, seg.loss_mask, strict=True) if not m]
    )
    assert injected == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    assert seg.completion_ids[-1] == end and seg.loss_mask[-1] == 1
    # Token in, token out: the context up to the last prompt is the template's render.
    fmt = chat_format(smol, TOOLS)
    before_last = fmt.render(first.messages[:-1])
    assert seg.context[: len(before_last)] == before_last
    ((prompt, completion),) = episode_samples(first)
    assert prompt == seg.prompt_ids and completion.loss_mask == seg.loss_mask
    assert completion.text == "The answer is 408." and completion.finish_reason == "stop"


@pytest.mark.parametrize(
    ("reply", "budgets", "reason"),
    [
        (lambda p: CALL, {"max_turns": 3}, "max_turns"),
        (lambda p: CALL + CALL, {"max_tool_calls": 1}, "max_tool_calls"),
        (lambda p: CALL, {"max_episode_tokens": 200}, "max_episode_tokens"),
        (lambda p: "x " * 200, {}, "truncated"),
        (lambda p: '<tool_call>{"name": multiply}</tool_call>', {}, "malformed_call"),
    ],
)
def test_budgets_and_malformed_calls_end_episodes_with_their_reason(
    smol: PreTrainedTokenizerBase, reply: Any, budgets: dict[str, Any], reason: str
) -> None:
    episodes, engine, _ = run(smol, reply, ["12*34?", "56*78?"], **budgets)
    assert [e.end_reason for e in episodes] == [reason, reason]
    assert len(engine.calls) <= budgets.get("max_turns", 4)
    assert all(len(e.context) <= 200 for e in episodes) or reason != "max_episode_tokens"
    metrics = episode_metrics(episodes)
    assert metrics[f"episode/end/{reason}"] == 1.0
    assert sum(metrics[f"episode/end/{r}"] for r in END_REASONS) == 1.0
    if reason == "malformed_call":
        assert metrics["tools/malformed"] == 1.0 and metrics["tools/calls"] == 0.0
    if reason == "max_turns":
        assert engine.calls == [2, 2, 2] and metrics["tools/calls"] == 2.0


def drifting(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """SmolLM2's template, but earlier assistant turns are re-rendered stripped of whitespace
    and of a <think> block (as reasoning templates do)."""
    other = copy.deepcopy(tokenizer)
    template = other.chat_template
    assert "message['content']" in template
    other.chat_template = template.replace(
        "message['content']", "(message['content'].split('</think>')[-1] | trim)"
    )
    return other


def thinking_reply(prompt: str) -> str:
    return "The answer is 408." if "<|im_start|>tool" in prompt else "<think>hmm</think> " + CALL


@pytest.mark.parametrize("policy", ["split", "drop"])
def test_template_drift_is_detected_and_counted(smol: PreTrainedTokenizerBase, policy: str) -> None:
    tokenizer = drifting(smol)
    fmt = chat_format(tokenizer, TOOLS)
    episodes, engine, _ = run(
        tokenizer, thinking_reply, ["12*34?"], fmt=fmt, on_template_drift=policy
    )
    (episode,) = episodes
    assert episode.drifts == 1
    metrics = episode_metrics(episodes)
    assert metrics["episode/template_drift"] == 1.0
    if policy == "drop":
        assert episode.end_reason == "template_drift" and episode.dropped
        assert episode_samples(episode) == [] and metrics["episode/dropped_frac"] == 1.0
        assert engine.calls == [1]
        return
    # Split: the first segment trains on its turn as sampled; the second starts from the new
    # render (the earlier turn as the template now writes it, not trained) and trains the next.
    assert episode.end_reason == "done" and engine.calls == [1, 1]
    first, second = episode.segments
    assert first.loss_mask == [1] * len(first.completion_ids)
    assert first.completion_ids == engine.sampled[0]
    assert "<think>" not in tokenizer.decode(second.prompt_ids)
    assert second.completion_ids == engine.sampled[1]
    assert [len(c.token_ids) for _, c in episode_samples(episode)] == [
        len(engine.sampled[0]),
        len(engine.sampled[1]),
    ]
    assert metrics["episode/samples_per_episode"] == 2.0


class TwoTurnEnvironment:
    """Asks a follow-up after the first answer, then ends with a reward."""

    def __init__(self) -> None:
        self.resets: list[str] = []

    def reset(
        self, episode_ids: Sequence[str], items: Sequence[Mapping[str, Any]]
    ) -> list[EnvStep]:
        self.resets.extend(episode_ids)
        return [EnvStep(messages=[{"role": "user", "content": "Answer directly."}])] * len(items)

    def step(
        self, episode_ids: Sequence[str], messages: Sequence[Sequence[Mapping[str, Any]]]
    ) -> list[EnvStep]:
        out = []
        for ms in messages:
            done = "again" in ms[-1]["content"]
            follow = [{"role": "user", "content": "Say it again."}]
            out.append(EnvStep(messages=[] if done else follow, reward=0.5, done=done))
        return out

    def close(self) -> None:
        pass


def test_an_environment_steps_turns_without_tool_calls(smol: PreTrainedTokenizerBase) -> None:
    def reply(prompt: str) -> str:
        return "408 again" if "Say it again" in prompt else "408"

    environment = TwoTurnEnvironment()
    episodes, engine, tools = run(smol, reply, ["12*34?", "1*2?"], environment=environment)
    assert environment.resets == [e.episode_id for e in episodes]
    assert engine.calls == [2, 2] and tools.batches == []
    assert [e.end_reason for e in episodes] == ["done", "done"]
    assert [e.env_reward for e in episodes] == [1.0, 1.0]
    assert episode_metrics(episodes)["episode/env_reward/mean"] == 1.0
    assert 0 < episode_metrics(episodes)["episode/masked_token_frac"] < 1
