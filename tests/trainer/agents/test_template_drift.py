"""A chat template that re-renders earlier turns differently (Llama-3's ``| trim``, Qwen3's
think-block stripping) no longer leaves turns untrained (issue 32): by default the episode goes
on from its own tokens and every sampled token trains; with ``split`` the share left out is a
metric."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from jobspec import GRPOSpec, JobSpec
from tests.agent_jobs import ScriptedEngine, agent_job
from tests.trainer.agents.test_driver import drifting, thinking_reply
from trainer.agents import ToolResult
from trainer.data.dataset import Example
from trainer.run.episodes import AgentRollout

HTTP_CALCULATOR = {
    "type": "function",
    "function": {"name": "multiply"},
    "implementation": {"type": "http", "endpoint": "calc"},
}


class Calculator:
    """The operator's tool endpoint, in process."""

    def call(
        self, endpoint: str, name: str, arguments: Sequence[Mapping[str, Any]], *, timeout_s: float
    ) -> list[ToolResult]:
        return [ToolResult(str(a["a"] * a["b"])) for a in arguments]


def rollout(tokenizer: PreTrainedTokenizerBase, **episode: Any) -> tuple[Any, ScriptedEngine]:
    spec = JobSpec.model_validate(
        agent_job(tools=[HTTP_CALCULATOR], environment=None, episode=episode)
    )
    agent = AgentRollout(spec, tokenizer, http_tools=Calculator())
    engine = ScriptedEngine(tokenizer, thinking_reply)
    rolled = agent.sample(
        engine,
        [[1]],
        [Example("What is 12 times 34?", "408")],
        2,
        GRPOSpec(group_size=2, max_new_tokens=128),
        seed=0,
    )
    return rolled, engine


def test_after_a_drift_every_sampled_turn_trains(smol: PreTrainedTokenizerBase) -> None:
    tokenizer = drifting(smol)
    rolled, engine = rollout(tokenizer)
    tool_turn = tokenizer.encode(
        "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    for completion, turns in zip(
        rolled.completions[0], (engine.sampled[0::2], engine.sampled[1::2]), strict=True
    ):
        # One sequence: the thinking call as sampled (the re-render would strip its think
        # block), the tool's turn as the template writes it, the answer; both turns train.
        assert completion.token_ids == turns[0] + tool_turn + turns[1]
        assert completion.loss_mask == [1] * len(turns[0]) + [0] * len(tool_turn) + [1] * len(
            turns[1]
        )
    ((metrics_n, metrics),) = rolled.metrics
    assert metrics_n == 2 and metrics["episode/template_drift"] == 1.0
    assert metrics["episode/sampled_left_out_frac"] == 0.0
    assert metrics["episode/end/done"] == 1.0


@pytest.mark.parametrize("policy", ["split", "drop"])
def test_what_a_drift_leaves_out_is_shown(smol: PreTrainedTokenizerBase, policy: str) -> None:
    rolled, engine = rollout(drifting(smol), on_template_drift=policy)
    ((_, metrics),) = rolled.metrics
    sampled = sum(len(ids) for ids in engine.sampled)
    left_out = engine.sampled[-2:] if policy == "split" else engine.sampled
    assert metrics["episode/sampled_left_out_frac"] == pytest.approx(
        sum(len(ids) for ids in left_out) / sampled
    )
