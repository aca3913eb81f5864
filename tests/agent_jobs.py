"""The agent jobs the tests share (issue 27): the tools (a calculator and four hostile ones), the
two-turn environment, the transcript graders, a small agent job spec, and the scripted model
that calls the tools (:class:`ScriptedEngine` answering with :func:`scripted_reply`).

The trainer tests hand the scripted engine to ``train()``; the service tests run it inside a
real worker process (tests/worker/scripted_agent_worker.py). A random model never writes a
well-formed tool call, so the tests that need calls script the model's turns and keep
everything else (the sandboxed tools, the environment, the graders, the training) real.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from trainer.rollout.base import Completion

SMOL_END = "<|im_end|>"


def tool(name: str, source: str, **properties: str) -> dict[str, Any]:
    """A python function tool of the spec; ``properties`` are its arguments' JSON types."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} tool.",
            "parameters": {
                "type": "object",
                "properties": {k: {"type": v} for k, v in properties.items()},
            },
        },
        "implementation": {"type": "python", "source": source},
    }


CALCULATOR = tool("multiply", "def multiply(a, b):\n    return a * b\n", a="integer", b="integer")
# Reads a file outside the sandbox, opens a socket, loops forever, prints (and returns) 100 MB.
HOSTILE = [
    tool("peek", "def peek():\n    return open('/etc/shadow').read()\n"),
    tool(
        "dial",
        "import socket\n\ndef dial():\n"
        "    return str(socket.create_connection(('1.1.1.1', 80), timeout=1))\n",
    ),
    tool("spin", "def spin():\n    while True:\n        pass\n"),
    tool("flood", "def flood():\n    print('x' * 100_000_000)\n    return 'x' * 100_000_000\n"),
]
# Two turns: the first answer is questioned, the second ends the episode; reward 1 when the
# episode's last answer is the row's answer.
TWO_TURNS = """
class Environment:
    def reset(self, item):
        self.answer = str(item["answer"])
        self.turns = 0
        return []

    def step(self, messages):
        self.turns += 1
        if self.turns < 2:
            return {"messages": [{"role": "user", "content": "Are you sure?"}], "reward": 0.0}
        right = self.answer in messages[-1]["content"]
        return {"messages": [], "reward": 1.0 if right else 0.0, "done": True}
"""
# Full marks when the final answer is the row's and the transcript shows a multiply call.
TRANSCRIPT_GRADER = """
def grade(sample, item):
    calls = [c["name"] for c in sample["tool_calls"]]
    roles = [m["role"] for m in sample["messages"]]
    assert "assistant" in roles
    used = 1.0 if "multiply" in calls else 0.5
    return used if str(item["answer"]) in sample["output_text"] else 0.0
"""
HAS_MESSAGES = """
def grade(sample, item):
    roles = [m["role"] for m in sample["messages"]]
    return 1.0 if roles.count("assistant") >= 1 and isinstance(sample["tool_calls"], list) else 0.0
"""


def agent_job(**fields: Any) -> dict[str, Any]:
    """A tiny agent job: four multiplication rows, the calculator, the two-turn environment;
    ``fields`` replace top-level sections."""
    rows = [{"prompt": f"What is {a} times {b}?", "answer": str(a * b)} for a, b in
            [(12, 34), (23, 45), (31, 27), (19, 41)]]  # fmt: skip
    job: dict[str, Any] = {
        "name": "tiny-agents",
        "model": "tiny-random-llama",
        "seed": 0,
        "dataset": {"rows": rows, "use_chat_template": True},
        "graders": [{"type": "python", "name": "transcript", "source": HAS_MESSAGES}],
        "tools": [CALCULATOR],
        "environment": {"type": "python", "source": TWO_TURNS, "weight": 0.5},
        "episode": {"max_turns": 4, "max_episode_tokens": 1024, "tool_timeout_s": 2.0},
        "grpo": {
            "steps": 2,
            "prompts_per_step": 2,
            "group_size": 2,
            "learning_rate": 0.001,
            "max_new_tokens": 8,
            "max_prompt_tokens": 1024,
            "micro_batch_size": 4,
        },
        "rollout": {"engine": "transformers", "dtype": "float32"},
        "checkpoint_interval": 0,
    }
    job.update(fields)
    return job


@dataclass
class ScriptedEngine:
    """A RolloutEngine whose turn is ``reply(prompt text)``, encoded by ``tokenizer`` plus the
    end token (finish "stop"), or cut at ``max_new_tokens`` (finish "length"); logprobs are
    -0.25 each. ``calls`` records the number of prompts of every generate call."""

    tokenizer: PreTrainedTokenizerBase
    reply: Callable[[str], str]
    end_token: str = SMOL_END
    calls: list[int] = field(default_factory=list)
    sampled: list[list[int]] = field(default_factory=list)

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        greedy: bool = False,
    ) -> list[list[Completion]]:
        assert n == 1
        self.calls.append(len(prompts))
        out = []
        for prompt in prompts:
            text = self.reply(str(self.tokenizer.decode(prompt)))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            ids.append(self.tokenizer.convert_tokens_to_ids(self.end_token))
            reason = "stop"
            if len(ids) > max_new_tokens:
                ids, reason = ids[:max_new_tokens], "length"
            self.sampled.append(ids)
            out.append([Completion(ids, [-0.25] * len(ids), text, reason)])  # type: ignore[arg-type]
        return out

    def sync_weights(self, model: object) -> float:
        return 0.0

    def close(self) -> None:
        pass


ANSWERS = itertools.count()


def scripted_reply(prompt: str) -> str:
    """The scripted model's turn (for the default tool prompt, SmolLM2's tokenizer): first it
    calls every tool the system turn lists, in that order (multiply with the question's numbers,
    the others without arguments); once results came back it answers with the multiply result,
    and asked again it answers again. One answer in three (counted in this process) is
    "unknown", so a group's rewards differ."""
    listed = prompt.split("Available tools:")[-1]
    if "<tool_call>" not in listed:
        a, b = re.findall(r"What is (\d+) times (\d+)", prompt)[-1]
        arguments = {"multiply": {"a": int(a), "b": int(b)}}
        names = re.findall(r'"name": "(\w+)"', listed)
        calls = [json.dumps({"name": n, "arguments": arguments.get(n, {})}) for n in names]
        return "\n".join(f"<tool_call>{c}</tool_call>" for c in calls)
    # The multiply result: the first tool turn after the calls (a tool turn, or a user turn).
    product = re.findall(r"(?:<\|im_start\|>tool\n|Tool result \(multiply\):\n)(\d+)", prompt)
    wrong = next(ANSWERS) % 3 == 2
    return f"The answer is {'unknown' if wrong or not product else product[0]}."
