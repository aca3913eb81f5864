"""Overlong shaping counts the model's own tokens of a turn, not the tool results and environment
messages an agent episode injects between turns (``max_new_tokens`` is a budget per turn)."""

from __future__ import annotations

import torch

from jobspec import GRPOSpec
from trainer.rollout.base import Completion
from trainer.scoring.collect import Group
from trainer.update.inputs import pack_groups, shaped_rewards
from trainer.update.shaping import longest_turns

SPEC = GRPOSpec(
    group_size=3,
    max_new_tokens=64,
    overlong={"enabled": True, "cache_tokens": 16},  # penalised from 48 tokens on
)


def _turns(*parts: tuple[int, int]) -> Completion:
    """A completion of (tokens, mask value) runs: 1 = the model's own, 0 = injected."""
    mask = [value for count, value in parts for _ in range(count)]
    return Completion([7] * len(mask), None, "x", "stop", loss_mask=mask)


def test_a_tool_using_episode_is_not_penalised_for_the_tool_results() -> None:
    direct = _turns((40, 1))  # a direct answer of 40 tokens
    episode = _turns((30, 1), (25, 0), (30, 1))  # a call, its result, then the answer
    long_turn = _turns((10, 1), (25, 0), (56, 1))  # its second turn nears the budget
    group = Group(
        row=0,
        prompt_ids=[1],
        completions=[direct, episode, long_turn],
        rewards=[1.0, 1.0, 1.0],
        per_grader={},
        zero_std=True,
    )
    batch = pack_groups([group], SPEC, torch.device("cpu"))
    shaped = shaped_rewards([group], batch, SPEC)
    # 40 and 30 are below the window: no penalty; 56 is half way through it: -0.5. Counting
    # every token of the episode (85) gave it the full -1.
    assert shaped.tolist() == [1.0, 1.0, 0.5]


def test_longest_turns_reads_runs_of_sampled_tokens() -> None:
    mask = torch.tensor(
        [
            [1, 1, 1, 0, 1, 0, 0],  # turns of 3 and 1
            [1, 1, 0, 0, 1, 1, 1],  # 2 and 3
            [0, 0, 0, 0, 0, 0, 0],  # nothing sampled (padding)
            [1, 1, 1, 1, 1, 0, 0],  # one turn, right-padded
        ],
        dtype=torch.float32,
    )
    assert longest_turns(mask).tolist() == [3.0, 3.0, 0.0, 5.0]
    assert longest_turns(torch.zeros(2, 0)).tolist() == [0.0, 0.0]
