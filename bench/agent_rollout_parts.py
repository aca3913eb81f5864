"""The instruments of bench.agent_rollouts: a vLLM engine whose every turn has a fixed length
(:class:`FixedTurnEngine`, under :func:`fixed_length_turns`), an environment timed apart from the
engine (:class:`TimedEnvironment`), and the python environment the episodes run against
(:data:`ENVIRONMENT_SOURCE`), and one run of a mode with its figures (:func:`run_mode`)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from bench.common import CpuWindow, median

__all__ = [
    "END_TOKEN",
    "ENVIRONMENT_SOURCE",
    "FixedTurnEngine",
    "TimedEnvironment",
    "filler",
    "fixed_length_turns",
    "print_run",
    "run_mode",
    "summary_of",
]

END_TOKEN = "<|im_end|>"

# The environment: a user message after each assistant turn (a question, after a filler of
# --env-words words standing in for a tool's long output), done after TURNS turns, reward 0.
ENVIRONMENT_SOURCE = """
TURNS = {turns}
FILLER = {filler!r}


class Environment:
    def reset(self, item):
        self.turns = 0
        return []

    def step(self, messages):
        self.turns += 1
        if self.turns >= TURNS:
            return {{"messages": [], "reward": 0.0, "done": True}}
        text = FILLER + "Are you sure? Check your answer and give it again."
        return {{"messages": [{{"role": "user", "content": text}}], "reward": 0.0}}
"""


@contextmanager
def fixed_length_turns() -> Iterator[None]:
    """Make every ``VLLMEngine.generate`` call sample exactly ``max_new_tokens`` tokens: its end
    tokens are masked until then (``min_tokens``), so no turn stops early."""
    from trainer.rollout import vllm_engine

    original = vllm_engine.sampling_params

    def patched(**kwargs: Any) -> Any:
        params = original(**kwargs)
        params.min_tokens = params.max_tokens or 0
        return params

    vllm_engine.sampling_params = patched  # type: ignore[assignment]
    try:
        yield
    finally:
        vllm_engine.sampling_params = original  # type: ignore[assignment]


class FixedTurnEngine:
    """The benchmark's engine in front of the real one: a turn of ``max_new_tokens`` is
    ``max_new_tokens - 1`` sampled tokens (the engine's stop tokens masked, see
    :func:`fixed_length_turns`) plus the end token appended (log-prob 0.0), finish "stop".
    Counts the engine's calls, prompt tokens, sampled tokens and seconds. ``keep_cache``
    False: the driver's ``keep_prefix_cache`` does nothing, so every call clears the cache."""

    def __init__(self, engine: Any, end_id: int) -> None:
        self.engine = engine
        self.end_id = end_id
        self.keep_cache = True
        self.reset()

    def keep_prefix_cache(self) -> AbstractContextManager[None]:
        return self.engine.keep_prefix_cache() if self.keep_cache else nullcontext()

    def reset(self) -> None:
        self.calls = 0
        self.prompts = 0
        self.prompt_tokens = 0
        self.sampled_tokens = 0
        self.seconds = 0.0
        self.short_turns = 0  # turns the engine ended before max_new_tokens - 1 (should be 0)
        self.cached_before = self.engine.prefill.cached_tokens

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        greedy: bool = False,
    ) -> list[list[Any]]:
        from trainer.rollout.base import Completion

        started = time.perf_counter()
        out = self.engine.generate(
            prompts,
            n,
            max_new_tokens=max_new_tokens - 1,
            temperature=temperature,
            seed=seed,
            greedy=greedy,
        )
        self.seconds += time.perf_counter() - started
        self.calls += 1
        self.prompts += len(prompts)
        self.prompt_tokens += sum(map(len, prompts))
        groups = []
        for group in out:
            turns = []
            for c in group:
                self.sampled_tokens += len(c.token_ids)
                self.short_turns += len(c.token_ids) != max_new_tokens - 1
                logprobs = None if c.logprobs is None else [*c.logprobs, 0.0]
                turns.append(Completion([*c.token_ids, self.end_id], logprobs, c.text, "stop"))
            groups.append(turns)
        return groups

    def sync_weights(self, model: object) -> float:
        return 0.0

    def close(self) -> None:
        self.engine.close()


class TimedEnvironment:
    """An :class:`~trainer.agents.Environment` that counts its calls and their seconds."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reset_counts()

    def reset_counts(self) -> None:
        self.calls = 0
        self.seconds = 0.0

    def _timed(self, op: str, *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return getattr(self.inner, op)(*args)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1

    def reset(self, episode_ids: Sequence[str], items: Sequence[Mapping[str, Any]]) -> Any:
        return self._timed("reset", episode_ids, items)

    def step(self, episode_ids: Sequence[str], messages: Sequence[Sequence[Any]]) -> Any:
        return self._timed("step", episode_ids, messages)

    def close(self) -> None:
        self.inner.close()


def filler(words: int) -> str:
    """A system turn of ``words`` words: the same text for every episode, as a tool prompt."""
    sentence = "you can call tools to compute exact answers before you reply"
    vocabulary = sentence.split(" ")
    return " ".join(vocabulary[i % len(vocabulary)] for i in range(words)) + "."


def run_mode(
    mode: str,
    engine: FixedTurnEngine,
    env: TimedEnvironment,
    fmt: Any,
    conversations: list[list[dict[str, Any]]],
    items: list[dict[str, Any]],
    settings: Any,
    label: str,
) -> dict[str, Any]:
    from trainer.agents import run_episodes, start_episodes
    from trainer.seeding import derive_seed

    engine.reset()
    engine.keep_cache = mode != "batched_cleared"
    env.reset_counts()
    load = os.getloadavg()[0]
    window = CpuWindow()
    started = time.perf_counter()
    if mode != "one_by_one":
        episodes = start_episodes(fmt, conversations, items, env)
        run_episodes(engine, fmt, episodes, settings, environment=env)
    else:
        episodes = []
        for i, (conversation, item) in enumerate(zip(conversations, items, strict=True)):
            (episode,) = start_episodes(fmt, [conversation], [item], env)
            own = dataclasses.replace(settings, seed=derive_seed(settings.seed, i))
            run_episodes(engine, fmt, [episode], own, environment=env)
            episodes.append(episode)
    seconds = time.perf_counter() - started
    cpu = window.close()
    ends: dict[str, int] = {}
    for e in episodes:
        ends[str(e.end_reason)] = ends.get(str(e.end_reason), 0) + 1
    n = len(episodes)
    return {
        "mode": mode,
        "seed": settings.seed,
        "seconds": seconds,
        "episodes": n,
        "episodes_per_s": n / seconds,
        "sampled_tokens": engine.sampled_tokens,
        "sampled_tokens_per_s": engine.sampled_tokens / seconds,
        "turn_tokens_incl_end": sum(s.sampled for e in episodes for s in e.segments),
        "prompt_tokens_prefilled": engine.prompt_tokens,
        "prompt_tokens_cached": engine.engine.prefill.cached_tokens - engine.cached_before,
        "turns_per_s": sum(e.turns for e in episodes) / seconds,
        "generate_calls": engine.calls,
        "prompts_generated": engine.prompts,
        "engine_seconds": engine.seconds,
        "engine_sampled_tokens_per_s": engine.sampled_tokens / max(engine.seconds, 1e-9),
        "environment_calls": env.calls,
        "environment_seconds": env.seconds,
        "other_seconds": seconds - engine.seconds - env.seconds,
        "short_turns": engine.short_turns,
        "turns": sum(e.turns for e in episodes),
        "end_reasons": ends,
        "template_drifts": sum(e.drifts for e in episodes),
        "loadavg_1m_before": load,
        "loadavg_1m_after": os.getloadavg()[0],
        "process_cpu_s": cpu["process_cpu_s"],
        "process_share": cpu["process_share"],
        "machine_busy": cpu["machine_busy"],
        "steal": cpu["steal"],
    }


def summary_of(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = (
        "seconds",
        "episodes_per_s",
        "turns_per_s",
        "sampled_tokens",
        "sampled_tokens_per_s",
        "prompt_tokens_prefilled",
        "prompt_tokens_cached",
        "generate_calls",
        "engine_seconds",
        "engine_sampled_tokens_per_s",
        "environment_seconds",
        "other_seconds",
        "process_share",
        "machine_busy",
    )
    return {f"median_{k}": median([float(r[k]) for r in runs]) for k in keys}


def print_run(run: dict[str, Any], prefix: str) -> None:
    print(
        f"{prefix} {run['mode']}: {run['episodes']} episodes, {run['sampled_tokens']} tokens in "
        f"{run['seconds']:.1f} s = {run['episodes_per_s']:.2f} episodes/s, "
        f"{run['turns_per_s']:.2f} turns/s ({run['prompt_tokens_cached']} of "
        f"{run['prompt_tokens_prefilled']} prompt tokens cached), "
        f"{run['sampled_tokens_per_s']:.1f} tok/s ({run['generate_calls']} generate calls, "
        f"engine {run['engine_seconds']:.1f} s, environment {run['environment_seconds']:.2f} s; "
        f"ends {run['end_reasons']}; load {run['loadavg_1m_before']:.1f}, "
        f"machine {run['machine_busy']:.0%} busy)",
        flush=True,
    )
