"""Python tools and environments run in the grader sandbox: results come back as text, a tool
that raises, overruns or reaches outside gives an error result (never an exception), and an
environment's instances keep their state between an episode's calls."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from grading.sandbox import build_sandbox_settings
from jobspec import ToolSpec
from trainer.agents import SandboxEnvironment, Toolbox, ToolCall

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

SETTINGS = build_sandbox_settings(
    processes=2, cpu_s=1.0, call_timeout_s=5.0, memory_mb=256, max_processes=64
)


def tool(name: str, source: str) -> ToolSpec:
    return ToolSpec.model_validate(
        {"function": {"name": name}, "implementation": {"type": "python", "source": source}}
    )


def test_python_tools_run_in_the_sandbox() -> None:
    tools = [
        tool("multiply", "def multiply(a, b):\n    return a * b\n"),
        tool("describe", "def describe(x):\n    return {'x': x, 'twice': [x, x]}\n"),
        tool("fail", "def fail():\n    raise ValueError('no such thing')\n"),
        tool("peek", "def peek():\n    return open('/etc/passwd').read()\n"),
        tool("spin", "def spin():\n    while True:\n        pass\n"),
    ]
    box = Toolbox(tools, timeout_s=2.0, sandbox_settings=SETTINGS)
    try:
        calls = [
            ToolCall("multiply", {"a": 12, "b": 34}),
            ToolCall("describe", {"x": "hi"}),
            ToolCall("multiply", {"a": 2, "b": 3}),
            ToolCall("fail", {}),
            ToolCall("peek", {}),
            ToolCall("multiply", {"a": 1}),  # a missing argument
            ToolCall("nope", {}),
            ToolCall("spin", {}),
        ]
        results = box.run(calls)
        assert [r.content for r in results[:3]] == [
            "408",
            '{"x": "hi", "twice": ["hi", "hi"]}',
            "6",
        ]
        assert all(r.error is None for r in results[:3])
        errors: dict[int, str] = {
            3: "ValueError: no such thing",
            4: "FileNotFoundError",  # the sandbox has no /etc
            5: "TypeError",
            6: "unknown tool",
        }
        for i, what in errors.items():
            assert results[i].error is not None and what in results[i].error, results[i]
            assert results[i].content.startswith("error: ")
        assert results[7].error is not None  # cut off at the tool's time limit
        assert box.schemas()[0] == {
            "type": "function",
            "function": tools[0].function.model_dump(exclude_none=True),
        }
    finally:
        box.close()


ENVIRONMENT = """
class Environment:
    def reset(self, item):
        self.question = item["question"]
        self.turns = 0
        return [{"role": "user", "content": self.question}]

    def step(self, messages):
        self.turns += 1
        done = self.turns >= 2
        follow = [] if done else [{"role": "user", "content": "Are you sure?"}]
        return {"messages": follow, "reward": 0.25 * self.turns, "done": done}
"""


def test_a_python_environment_keeps_each_episodes_state_in_the_sandbox() -> None:
    env = SandboxEnvironment(ENVIRONMENT, "Environment", timeout_s=5.0, settings=SETTINGS)
    try:
        items: list[dict[str, Any]] = [{"question": "1+1?"}, {"question": "2+2?"}]
        resets = env.reset(["a", "b"], items)
        assert [r.messages for r in resets] == [
            [{"role": "user", "content": "1+1?"}],
            [{"role": "user", "content": "2+2?"}],
        ]
        answer = [{"role": "assistant", "content": "2"}]
        first = env.step(["a", "b"], [answer, answer])
        assert [(s.done, s.reward, s.error) for s in first] == [(False, 0.25, None)] * 2
        assert first[0].messages == [{"role": "user", "content": "Are you sure?"}]
        second = env.step(["a"], [answer])
        assert (second[0].done, second[0].reward) == (True, 0.5)
        unknown = env.step(["zzz"], [answer])  # never reset: an error, not an exception
        assert unknown[0].error is not None and "KeyError" in unknown[0].error
    finally:
        env.close()
