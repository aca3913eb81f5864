"""What the rollout viewer gets of an agent episode: its turns after the row's conversation
(model turns with their tool calls, tool results, environment messages) and its end reason,
bounded; and the step's samples carrying them (single completions carry none)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from tests.trainer.agents.test_driver import CALL, TwoTurnEnvironment, run
from trainer.agents import sample_transcript
from trainer.agents.episode import Episode
from trainer.agents.samples import (
    MAX_LABEL_CHARS,
    MAX_REASONS,
    MAX_TRANSCRIPT_CHARS,
    MAX_TRANSCRIPT_TURNS,
    MAX_TURN_CHARS,
)
from trainer.rollout.base import Completion
from trainer.run.metrics import build_samples
from trainer.scoring.collect import Collected, Group


def turn(source: str, role: str, content: str, **extra: Any) -> dict[str, Any]:
    """A transcript turn with every key, as sample_transcript writes it."""
    base: dict[str, Any] = {
        "source": source,
        "role": role,
        "content": content,
        "content_cut": 0,
        "name": None,
        "tool_calls": [],
        "malformed": [],
        "error": None,
    }
    return {**base, **extra}


def tool_then_answer(prompt: str) -> str:
    if "Say it again" in prompt:
        return "408 again"
    if "<|im_start|>tool" in prompt:
        return "The answer is 408."
    return "Let me compute. " + CALL


def test_an_episode_transcript_has_the_turns_tool_calls_results_and_end_reason(
    smol: PreTrainedTokenizerBase,
) -> None:
    (episode,), _, _ = run(smol, tool_then_answer, ["12*34?"], environment=TwoTurnEnvironment())
    transcript = sample_transcript(episode)
    call = {"name": "multiply", "arguments": '{"a": 12, "b": 34}', "arguments_cut": 0}
    assert transcript == {
        "end_reason": "done",
        "end_detail": None,
        "turns": [
            turn("environment", "user", "Answer directly."),  # the environment's reset
            turn("model", "assistant", "Let me compute.", tool_calls=[call]),
            turn("tool", "tool", "408", name="multiply"),
            turn("model", "assistant", "The answer is 408."),
            turn("environment", "user", "Say it again."),
            turn("model", "assistant", "408 again"),
        ],
        "turns_left_out": 0,
    }
    json.dumps(transcript)  # what the worker stores as it is
    # The graders' transcript is the conversation as rendered, untouched by the viewer's log.
    assert all(set(m) <= {"role", "content", "name"} for m in episode.messages)


def test_a_turn_whose_call_cannot_be_read_is_shown_as_written(
    smol: PreTrainedTokenizerBase,
) -> None:
    bad = 'Computing <tool_call>{"name": multiply}</tool_call>'
    (episode,), _, _ = run(smol, lambda p: bad, ["12*34?"])
    transcript = sample_transcript(episode)
    assert transcript["end_reason"] == "malformed_call"
    assert transcript["end_detail"] is not None and transcript["end_detail"].startswith("not JSON")
    (shown,) = transcript["turns"]
    assert shown["content"] == bad and shown["tool_calls"] == []
    assert len(shown["malformed"]) == 1 and shown["malformed"][0].startswith("not JSON")


def episode_with(log: Sequence[dict[str, Any]]) -> Episode:
    episode = Episode.start(0, {}, [{"role": "user", "content": "q"}], [1, 2, 3])
    episode.log.extend(log)
    episode.end("max_turns")
    return episode


def text_chars(transcript: dict[str, Any]) -> int:
    """Every string the bounds cover, summed."""
    total = 0
    for t in transcript["turns"]:
        total += len(t["content"]) + len(t["name"] or "") + len(t["error"] or "")
        total += sum(len(r) for r in t["malformed"])
        total += sum(len(c["name"]) + len(c["arguments"]) for c in t["tool_calls"])
    return total


def test_a_long_turn_is_cut_and_counted() -> None:
    long_args = {"text": "y" * 3 * MAX_TURN_CHARS}
    model = {
        "source": "model",
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "echo", "arguments": long_args}],
        "malformed": [],
    }
    result = {"source": "tool", "role": "tool", "name": "echo", "content": "x" * 5000}
    result["error"] = "e" * 1000
    transcript = sample_transcript(episode_with([model, result]))
    first, second = transcript["turns"]
    (call,) = first["tool_calls"]
    arguments = json.dumps(long_args)
    assert call["arguments"] == arguments[:MAX_TURN_CHARS]
    assert call["arguments_cut"] == len(arguments) - MAX_TURN_CHARS
    assert second["content"] == "x" * MAX_TURN_CHARS and second["content_cut"] == 5000 - 1000
    assert second["error"] == "e" * MAX_LABEL_CHARS
    assert transcript["turns_left_out"] == 0 and transcript["end_reason"] == "max_turns"
    # A turn of many unreadable calls shows the first reasons only.
    garbled = {**model, "tool_calls": [], "malformed": [f"bad {i}" for i in range(40)]}
    (shown,) = sample_transcript(episode_with([garbled]))["turns"]
    assert shown["malformed"] == [f"bad {i}" for i in range(MAX_REASONS)]


def test_turns_past_the_turn_cap_are_left_out_and_counted() -> None:
    log = [{"source": "environment", "role": "user", "content": f"turn {i}"} for i in range(40)]
    transcript = sample_transcript(episode_with(log))
    assert [t["content"] for t in transcript["turns"]] == [
        f"turn {i}" for i in range(MAX_TRANSCRIPT_TURNS)
    ]
    assert transcript["turns_left_out"] == 40 - MAX_TRANSCRIPT_TURNS


def test_the_whole_transcript_is_bounded_and_the_rest_left_out() -> None:
    big = [{"source": "environment", "role": "user", "content": "z" * 5000} for _ in range(10)]
    transcript = sample_transcript(episode_with(big))
    full_turns = MAX_TRANSCRIPT_CHARS // MAX_TURN_CHARS
    assert len(transcript["turns"]) == full_turns
    assert all(t["content_cut"] == 5000 - MAX_TURN_CHARS for t in transcript["turns"])
    assert transcript["turns_left_out"] == 10 - full_turns
    assert text_chars(transcript) == MAX_TRANSCRIPT_CHARS
    # A budget spent inside a turn cuts that turn and leaves out the ones after it.
    uneven = [{"source": "environment", "role": "user", "content": "z" * 700} for _ in range(10)]
    cut = sample_transcript(episode_with(uneven))
    assert [t["content_cut"] for t in cut["turns"]] == [0, 0, 0, 0, 0, 700 - 500]
    assert cut["turns_left_out"] == 4 and text_chars(cut) == MAX_TRANSCRIPT_CHARS


def group(row: int, rewards: list[float], transcripts: list[dict[str, Any]] | None) -> Group:
    completions = [Completion([5, 6], [-0.1, -0.2], f"answer {r}", "stop") for r in rewards]
    return Group(
        row=row,
        prompt_ids=[1, 2],
        completions=completions,
        rewards=rewards,
        per_grader={"g": rewards},
        zero_std=False,
        transcripts=transcripts,
    )


def test_build_samples_carry_each_episode_transcript_and_none_for_single_completions() -> None:
    episodes = [
        {"end_reason": "done", "turns": [turn("model", "assistant", "a")], "turns_left_out": 0},
        {"end_reason": "max_turns", "turns": [], "turns_left_out": 3},
    ]
    agent, single = group(0, [1.0, 0.0], episodes), group(1, [0.5, 0.0], None)
    col = Collected(groups=[agent, single], kept=[agent, single])
    samples = build_samples(col, {0: [1.0, -1.0], 1: [0.5, -0.5]}, ["p0", "p1"], ["a0", None], 2)
    assert [c.transcript for c in samples[0].completions] == episodes
    assert [c.transcript for c in samples[1].completions] == [None, None]
    # The worker stores dataclasses.asdict of each group: the transcript goes in as JSON.
    stored = json.loads(json.dumps(dataclasses.asdict(samples[0])))
    assert [c["transcript"] for c in stored["completions"]] == episodes
