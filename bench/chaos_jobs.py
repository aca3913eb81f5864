"""The chaos run's job mix: which kinds of job it submits, in what shares and order, and each
kind's spec. Every spec is a valid API job (`JobSpec.model_validate` takes each kind, checked by
`python -m bench.chaos_jobs`).

- `tiny`: today's small job (the tiny model, transformers rollouts, a checkpoint every 2 steps,
  so that a resumed attempt starts from one);
- `lora`: the same with a rank-8 LoRA adapter, which the inference tier serves as an adapter
  over its warm base engine;
- `async`: `grpo.async.max_staleness` 1, so the job runs a rollout server process of its own
  (`python -m trainer.rollout.rollout_server`) that the run kills;
- `agent`: a python tool (a calculator) and a python two-turn environment, both run in the
  sandbox; the tiny random model never writes a tool call, the environment still runs its turns;
- `two_device`: `resources.devices` 2, run by the cluster's two-device worker under torchrun
  (two gloo ranks on the CPU).
"""

from __future__ import annotations

import random
from typing import Any

TINY = "tiny-random-llama"
KINDS = ("tiny", "lora", "async", "agent", "two_device")
# Shares of the jobs (the rest are `tiny`); at least one of each once the run has a job for
# every kind. Kinds a run leaves out (`--mix tiny`) are not planned at all.
SHARES = {"lora": 0.15, "async": 0.2, "agent": 0.15, "two_device": 0.15}
MIXES = {"all": KINDS, "tiny": ("tiny",)}
# What the async jobs ask for: one version of staleness, one server thread (the machine has
# 2 cores), and a mismatch bound no healthy run reaches (the guard would pause the job, which
# the checks would count as lost; the guard itself is tested in tests/worker).
ASYNC = {"max_staleness": 1, "server_threads": 1, "max_mismatch": 100, "max_capped_frac": 1.0}

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
    "implementation": {"type": "python", "source": "def multiply(a, b):\n    return a * b\n"},
}
# Two turns: the first answer is questioned, the second ends the episode; reward 1 when the
# last answer holds the row's answer.
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
AGENT_ROWS = [
    {"prompt": f"What is {a} times {b}? Use the tool.", "answer": str(a * b)}
    for a, b in [(12, 34), (23, 45), (31, 27), (19, 41), (17, 29), (43, 12), (26, 38), (14, 33)]
]


def plan_kinds(jobs: int, rng: random.Random, mix: str = "all") -> list[str]:
    """The kind of each job, by submission order: the shares (at least one of each special
    kind when there are jobs enough for every kind), shuffled; an async job first and a
    two-device job second, so that the rollout server and the two-device worker are busy
    from the first faults on."""
    kinds = MIXES[mix]
    counts = {k: 0 for k in kinds}
    for kind, share in SHARES.items():
        if kind in counts:
            counts[kind] = round(share * jobs)
            if jobs >= len(kinds):
                counts[kind] = max(1, counts[kind])
    special = sum(counts.values())
    while special > jobs:  # few jobs: drop specials, the largest share first
        kind = max(counts, key=lambda k: counts[k])
        counts[kind] -= 1
        special -= 1
    if "tiny" in counts:
        counts["tiny"] = jobs - special
    order = [kind for kind in kinds for _ in range(counts[kind])]
    rng.shuffle(order)
    for position, kind in enumerate(("async", "two_device")):
        if kind in order[position:] and position < len(order):
            found = order.index(kind, position)
            order[position], order[found] = order[found], order[position]
    return order


def steps_for(kind: str, mean_steps: int, rng: random.Random) -> int:
    """A job's steps: around the run's mean, halved for the kinds whose steps cost about twice
    a tiny one on this machine (two ranks on 2 cores; two turns per episode)."""
    steps = rng.randint(max(2, mean_steps // 2), max(3, mean_steps * 3 // 2))
    if kind in ("two_device", "agent"):
        steps = max(2, steps // 2)
    return steps


def job_spec(index: int, steps: int, kind: str = "tiny") -> dict[str, Any]:
    """Job `index` of `kind` with `steps` steps."""
    spec: dict[str, Any] = {
        "name": f"chaos-{index}-{kind}",
        "model": TINY,
        "dataset": {"generator": {"type": "arithmetic", "count": 16}},
        "graders": [{"type": "numeric_match"}],
        "grpo": {"steps": steps, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
        "rollout": {"engine": "transformers"},
        "checkpoint_interval": 2,
        "seed": index,
    }
    if kind == "lora":
        spec["lora"] = {"rank": 8}
    elif kind == "async":
        spec["grpo"]["async"] = dict(ASYNC)
    elif kind == "two_device":
        spec["resources"] = {"devices": 2}
    elif kind == "agent":
        spec["dataset"] = {"rows": AGENT_ROWS, "use_chat_template": True}
        spec["tools"] = [CALCULATOR]
        spec["environment"] = {"type": "python", "source": TWO_TURNS, "weight": 0.5}
        spec["episode"] = {"max_turns": 4, "max_episode_tokens": 1024, "tool_timeout_s": 2.0}
        spec["grpo"]["max_prompt_tokens"] = 1024
    elif kind != "tiny":
        raise ValueError(f"unknown job kind {kind!r}")
    return spec


def _check() -> None:
    """Each kind's spec validates as the API would take it."""
    from jobspec.job import JobSpec

    for kind in KINDS:
        spec = JobSpec.model_validate(job_spec(0, 4, kind))
        print(f"{kind}: valid ({spec.name})")
    print(plan_kinds(12, random.Random(1)), plan_kinds(30, random.Random(1)))


if __name__ == "__main__":
    _check()
