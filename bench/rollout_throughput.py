"""Rollout throughput: the vLLM engine vs the transformers engine, through ``make_engine``.

Both engines run in this one process on the same prompts (SmolLM2-135M-Instruct, arithmetic
questions formatted with the chat template), G completions each, interleaved call by call so
that background load hits both alike. A warm-up call per engine is excluded; the reported
figures are medians over ``--repeats`` timed calls. Tokens counted are the completion tokens the
engine returned (eos included when sampled), so tokens/s is engine work per wall second.

Run (from the repository root):

    .venv/bin/python -m bench.rollout_throughput                 # float32, 32 x 8, 64 tokens
    .venv/bin/python -m bench.rollout_throughput --dtype bfloat16 --repeats 5

Writes bench/results/rollout_throughput[_<dtype>].json (float32: no suffix).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

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

ISSUE_TARGET_RATIO = 2.5
TRAINER_MODULES = (
    "jobspec",
    "trainer.data.dataset",
    "trainer.models.loading",
    "trainer.rollout.registry",
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per engine")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="engine precision (the trainer's default rollout dtype is float32)",
    )
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def _timed_call(
    engine: Any, prompts: list[list[int]], args: argparse.Namespace, seed: int
) -> dict[str, float]:
    load = os.getloadavg()[0]
    window = CpuWindow()
    started = time.perf_counter()
    groups = engine.generate(
        prompts,
        args.n,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=seed,
    )
    seconds = time.perf_counter() - started
    cpu = window.close()
    comps = [c for group in groups for c in group]
    tokens = sum(len(c.token_ids) for c in comps)
    return {
        "seed": seed,
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "mean_completion_tokens": tokens / len(comps),
        "truncated_frac": sum(c.finish_reason == "length" for c in comps) / len(comps),
        "loadavg_1m_before": load,
        "process_cpu_s": cpu["process_cpu_s"],
        "process_share": cpu["process_share"],
        "machine_busy": cpu["machine_busy"],
        "steal": cpu["steal"],
        "tokens_per_cpu_s": tokens / max(cpu["process_cpu_s"], 1e-9),
    }


def _summary(calls: list[dict[str, float]]) -> dict[str, float]:
    return {
        "median_seconds": median([c["seconds"] for c in calls]),
        "median_tokens": median([c["tokens"] for c in calls]),
        "median_tokens_per_s": median([c["tokens_per_s"] for c in calls]),
        "mean_completion_tokens": median([c["mean_completion_tokens"] for c in calls]),
        "median_tokens_per_cpu_s": median([c["tokens_per_cpu_s"] for c in calls]),
        "median_process_share": median([c["process_share"] for c in calls]),
    }


def _import_trainer_modules() -> None:
    """Import what the run uses of the project up front: the load snapshot and torch's thread
    count are taken after these imports (an import may set torch's threads)."""
    for name in TRAINER_MODULES:
        importlib.import_module(name)


def _encoded_prompts(args: argparse.Namespace) -> tuple[Path, Any, Any, list[list[int]]]:
    """The model's folder, its float32 policy and tokenizer, and ``--prompts`` arithmetic
    prompts encoded with the chat template."""
    from jobspec import DatasetSpec, PromptRow
    from trainer.data.dataset import Example, encode_prompts
    from trainer.models.loading import load_policy, resolve_model

    rows = arithmetic_rows(args.prompts, seed=0)
    model_path = resolve_model(args.model)
    model, tokenizer = load_policy(model_path, dtype=torch.float32)
    spec = DatasetSpec(rows=[PromptRow(**r) for r in rows])  # chat template on by default
    prompts = encode_prompts(
        tokenizer, [Example(r["prompt"], r["answer"]) for r in rows], spec, max_prompt_tokens=256
    )
    return model_path, model, tokenizer, prompts


def _start_engines(
    args: argparse.Namespace, model_path: Path, tokenizer: Any, model: Any, max_model_len: int
) -> tuple[dict[str, Any], float]:
    """Both engines, vLLM first; returns them and the seconds vLLM's took to start."""
    from trainer.rollout.registry import make_engine

    started = time.perf_counter()
    engines = {
        "vllm": make_engine(
            "vllm",
            model_path,
            tokenizer,
            dtype=args.dtype,
            max_model_len=max_model_len,
            kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
        ),
    }
    vllm_start_s = time.perf_counter() - started
    engines["transformers"] = make_engine(
        "transformers",
        model_path,
        tokenizer,
        dtype=args.dtype,
        max_model_len=max_model_len,
        policy_model=model,
    )
    return engines, vllm_start_s


def _interleaved_calls(
    engines: dict[str, Any], prompts: list[list[int]], args: argparse.Namespace
) -> tuple[dict[str, dict[str, float]], dict[str, list[dict[str, float]]]]:
    """One warm-up call per engine, then ``--repeats`` timed calls each, interleaved; returns
    (warm-up call, timed calls) per engine."""
    calls: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    warmup: dict[str, dict[str, float]] = {}
    order = list(engines)
    for name in order:
        warmup[name] = _timed_call(engines[name], prompts, args, seed=1000)
        print(f"warm-up {name}: {warmup[name]['tokens_per_s']:.1f} tok/s", flush=True)
    for rep in range(args.repeats):
        # Alternate which engine goes first so that drifting load is shared evenly.
        for name in order if rep % 2 == 0 else order[::-1]:
            call = _timed_call(engines[name], prompts, args, seed=rep)
            calls[name].append(call)
            print(
                f"repeat {rep} {name}: {call['tokens']} tokens in {call['seconds']:.1f} s = "
                f"{call['tokens_per_s']:.1f} tok/s (process used {call['process_share']:.2f} "
                f"cores, machine {call['machine_busy']:.0%} busy)",
                flush=True,
            )
    return warmup, calls


def _close_engines(engines: dict[str, Any]) -> None:
    """Close both engines and collect them, so the process's memory is freed before the end."""
    for engine in engines.values():
        engine.close()
    engines.clear()
    gc.collect()


def _settings(
    args: argparse.Namespace, model_path: Path, max_model_len: int, prompts: list[list[int]]
) -> dict[str, Any]:
    """The run's settings as the JSON records them."""
    return {
        "model": args.model,
        "model_path": str(model_path),
        "dtype": args.dtype,
        "prompts": args.prompts,
        "completions_per_prompt": args.n,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "sampling": "full vocabulary (top_k 0, top_p 1)",
        "repeats": args.repeats,
        "warmup_calls_excluded": 1,
        "max_model_len": max_model_len,
        "kv_cache_gib": args.kv_cache_gib,
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "interface": "trainer.rollout.registry.make_engine(...).generate(prompts, n, ...)",
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Time both engines, write the JSON and print the ratio; returns the JSON's content."""
    args = _parse(argv)
    _import_trainer_modules()
    before = load_snapshot()
    threads_at_start = torch.get_num_threads()
    model_path, model, tokenizer, prompts = _encoded_prompts(args)
    max_model_len = 256 + args.max_new_tokens
    engines, vllm_start_s = _start_engines(args, model_path, tokenizer, model, max_model_len)
    warmup, calls = _interleaved_calls(engines, prompts, args)
    threads_after = torch.get_num_threads()
    _close_engines(engines)

    summary = {name: _summary(c) for name, c in calls.items()}
    ratio = summary["vllm"]["median_tokens_per_s"] / summary["transformers"]["median_tokens_per_s"]
    cpu_ratio = (
        summary["vllm"]["median_tokens_per_cpu_s"]
        / summary["transformers"]["median_tokens_per_cpu_s"]
    )
    result: dict[str, Any] = {
        "benchmark": "rollout_throughput",
        "command": "python -m bench.rollout_throughput "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": _settings(args, model_path, max_model_len, prompts),
        "machine": machine_info(),
        "torch_threads": {"start": threads_at_start, "after_engines": threads_after},
        "vllm_engine_start_s": vllm_start_s,
        "load_before": before,
        "load_after": load_snapshot(),
        "warmup": warmup,
        "calls": calls,
        "summary": summary,
        "ratio_tokens_per_s_vllm_over_transformers": ratio,
        "ratio_tokens_per_cpu_s_vllm_over_transformers": cpu_ratio,
        "issue_target_ratio": ISSUE_TARGET_RATIO,
        "meets_target": ratio >= ISSUE_TARGET_RATIO,
        "peak_rss_bytes_process": maxrss_bytes(),
    }
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    out = args.out or RESULTS_DIR / f"rollout_throughput{suffix}.json"
    write_json(out, result)
    print(
        f"vLLM {summary['vllm']['median_tokens_per_s']:.1f} tok/s, transformers "
        f"{summary['transformers']['median_tokens_per_s']:.1f} tok/s, ratio {ratio:.2f}x "
        f"(target >= {ISSUE_TARGET_RATIO}x); written to {out}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
