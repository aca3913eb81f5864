"""GRPO step time and peak memory: our trainer vs TRL's GRPOTrainer, at equal settings.

SmolLM2-135M-Instruct, fp32, CPU; arithmetic prompts ("What is a+b? Answer with a number.",
single digits) formatted with the chat template; 8 prompts x 8 completions per optimizer step,
max 64 new tokens, temperature 1 (full vocabulary), beta 0.04 with the k3 estimator in the loss,
DAPO token-mean loss aggregation, eps 0.2 / 0.28, lr 1e-6 constant, one update per batch
(num_iterations 1, no minibatching), micro-batches of 16, grad-norm clip 1.0, numeric-match
reward, group-std-scaled advantages. Both sides see the same prompts in the same order (no
shuffling): step k trains on rows 8k..8k+7.

Configurations (each in a fresh subprocess, so peak RSS is per configuration):

- ``ours-vllm``: our trainer with its default engine (vLLM, float32, weights pushed each step,
  KV cache sized to the batch, gradient checkpointing on);
- ``ours-transformers``: our trainer generating with transformers ``generate`` (as TRL does);
- ``trl``: TRL's GRPOTrainer, run by ``bench/trl_step.py`` in ``.venv-trl`` (transformers
  generate, its default on CPU; gradient checkpointing on, its default);
- optional variants of ours: ``-bf16`` (engine in bfloat16), ``-kvN`` (vLLM KV cache of N GiB
  instead of the batch-sized default), ``-nogc`` (gradient checkpointing off), ``-tbf16``
  (training in bfloat16 mixed precision), ``-loraN`` (LoRA adapters of rank N, alpha 2N, all
  linear layers), e.g. ``ours-vllm-kv2-nogc`` (the previous defaults), ``ours-vllm-bf16`` or
  ``ours-vllm-lora16``.

Run (from the repository root; about 15 to 25 minutes on 2 cores):

    .venv/bin/python -m bench.step_vs_trl
    .venv/bin/python -m bench.step_vs_trl --steps 4 --configs ours-vllm,trl

Step time is the median over the steps after the first (the first is a warm-up); peak RSS is
sampled (process + children, every 0.2 s) from process start to the end of the last step.
Writes bench/results/step_vs_trl.json; child logs go to a temporary folder named in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import (
    RESULTS_DIR,
    arithmetic_rows,
    load_snapshot,
    machine_info,
    median,
    write_json,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = "ours-vllm,ours-transformers,trl"
OURS_PHASES = ("time/rollout", "time/reward", "time/logprobs", "time/update", "time/weight_sync")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per run (first = warm-up)")
    parser.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help=(
            "comma-separated: ours-vllm, ours-transformers, trl; ours-* take -bf16 / -kvN / "
            "-nogc / -tbf16 / -loraN"
        ),
    )
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--trl-python", type=Path, default=REPO / ".venv-trl" / "bin" / "python")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per configuration")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "step_vs_trl.json")
    return parser.parse_args(argv)


def _command(name: str, config_path: Path, out: Path, trl_python: Path) -> list[str]:
    if name == "trl":
        return [
            str(trl_python),
            str(REPO / "bench" / "trl_step.py"),
            "--config",
            str(config_path),
            "--out",
            str(out),
        ]
    if not name.startswith("ours-"):
        raise ValueError(f"unknown configuration {name!r}")
    parts = name.split("-")
    engine = parts[1]
    options: list[str] = []
    for option in parts[2:]:
        if option == "bf16":
            options += ["--dtype", "bfloat16"]
        elif option.startswith("kv") and option[2:].isdigit():
            options += ["--kv-cache-gib", option[2:]]
        elif option == "nogc":
            options.append("--no-gradient-checkpointing")
        elif option == "tbf16":
            options += ["--train-dtype", "bfloat16"]
        elif option.startswith("lora") and option[4:].isdigit():
            options += ["--lora-rank", option[4:]]
        else:
            raise ValueError(f"unknown option {option!r} in configuration {name!r}")
    return [
        sys.executable,
        "-m",
        "bench.ours_step",
        "--config",
        str(config_path),
        "--engine",
        engine,
        *options,
        "--out",
        str(out),
    ]


def _cpu_summary(measured: list[dict[str, Any]]) -> dict[str, float]:
    cpus = [s["cpu"] for s in measured if s.get("cpu")]
    return {
        "median_step_cpu_s": median([c["process_cpu_s"] for c in cpus]),
        "median_process_share": median([c["process_share"] for c in cpus]),
        "median_machine_busy": median([c["machine_busy"] for c in cpus]),
        "median_loadavg_1m": median([s["loadavg_1m"] for s in measured]),
    }


def _summarise_ours(raw: dict[str, Any]) -> dict[str, Any]:
    measured = raw["steps"][1:] or raw["steps"]
    out: dict[str, Any] = {
        "median_step_s": median([s["time/step"] for s in measured]),
        "median_wall_between_steps_s": median(
            [s["wall_since_previous"] for s in measured if s["wall_since_previous"] is not None]
        ),
        "warmup_step_s": raw["steps"][0]["time/step"] if raw["steps"] else None,
        "phases_median_s": {
            p.split("/")[1]: median([s.get(p, 0.0) for s in measured]) for p in OURS_PHASES
        },
        "mean_completion_tokens": median([s["completion_len/mean"] for s in measured]),
        "reward_mean": median([s["reward/mean"] for s in measured]),
        "rollout_tokens_per_s": median([s["tokens_per_s/rollout"] for s in measured]),
        **_cpu_summary(measured),
    }
    return out


def _summarise_trl(raw: dict[str, Any]) -> dict[str, Any]:
    measured = raw["steps"][1:] or raw["steps"]
    by_step = {entry["step"]: entry for entry in raw["logs"] if "reward" in entry}
    lengths = [
        by_step[s["step"]].get("completions/mean_length") for s in measured if s["step"] in by_step
    ]
    rewards = [by_step[s["step"]].get("reward") for s in measured if s["step"] in by_step]
    return {
        "median_step_s": median([s["seconds"] for s in measured]),
        "median_wall_between_steps_s": median(
            [
                s["wall_since_previous_step_end"]
                for s in measured
                if s["wall_since_previous_step_end"] is not None
            ]
        ),
        "warmup_step_s": raw["steps"][0]["seconds"] if raw["steps"] else None,
        "phases_median_s": {
            "rollout": median([s["rollout"] for s in measured]),
            "ref_logprobs": median([s["ref_logprobs"] for s in measured]),
            "generate_and_score": median([s["generate_and_score"] for s in measured]),
            "update": median([s["update"] for s in measured]),
        },
        "mean_completion_tokens": median([x for x in lengths if x is not None]),
        "reward_mean": median([x for x in rewards if x is not None]),
        **_cpu_summary(measured),
    }


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings both sides train with, as the config file and the JSON record them."""
    return {
        "steps": args.steps,
        "warmup_steps_excluded": 1,
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "completions_per_step": args.prompts_per_step * args.group_size,
        "micro_batch_size": args.micro_batch_size,
        "max_new_tokens": args.max_new_tokens,
        "temperature": 1.0,
        "learning_rate": 1e-6,
        "max_grad_norm": 1.0,
        "beta": 0.04,
        "kl_estimator": "k3 (placement loss)",
        "loss_aggregation": "DAPO token mean (ours token_mean, TRL loss_type dapo)",
        "eps_low": 0.2,
        "eps_high": 0.28,
        "num_iterations": 1,
        "advantages": "group-centred, divided by the group std",
        "reward": "numeric match of the completion's last number",
        "precision": (
            "float32 training unless the config says tbf16; generation float32 unless it says bf16"
        ),
        "seed": 0,
    }


def _run_configuration(
    name: str, config_path: Path, workdir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """Run one configuration in its own process (log and result in `workdir`); returns its
    entry: the command, exit status, load, and the summary and raw result when it succeeded
    (else the log's tail)."""
    out = workdir / f"{name}.json"
    log = workdir / f"{name}.log"
    cmd = _command(name, config_path, out, args.trl_python)
    print(f"== {name}: {' '.join(cmd)} (log {log})", flush=True)
    before = load_snapshot()
    started = time.perf_counter()
    with open(log, "w") as handle:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            stdout=handle,
            stderr=subprocess.STDOUT,
            timeout=args.timeout,
            check=False,
        )
    entry: dict[str, Any] = {
        "command": cmd,
        "returncode": proc.returncode,
        "process_seconds": time.perf_counter() - started,
        "log": str(log),
        "load_before": before,
        "load_after": load_snapshot(),
    }
    if proc.returncode == 0 and out.is_file():
        raw = json.loads(out.read_text())
        summary = _summarise_trl(raw) if name == "trl" else _summarise_ours(raw)
        summary["peak_rss_bytes"] = raw["peak_rss_bytes_sampled"]
        summary["peak_rss_gib"] = raw["peak_rss_bytes_sampled"] / 2**30
        entry.update(summary=summary, raw=raw)
        print(
            f"   {name}: {summary['median_step_s']:.1f} s/step "
            f"({summary['median_step_cpu_s']:.1f} CPU s), peak RSS "
            f"{summary['peak_rss_gib']:.2f} GiB",
            flush=True,
        )
    else:
        entry["log_tail"] = log.read_text()[-4000:] if log.is_file() else ""
        print(f"   {name} FAILED (rc {proc.returncode}); see {log}", flush=True)
    return entry


def _ratios_over_trl(runs: dict[str, Any]) -> dict[str, Any]:
    """Each of our configurations that ran against TRL's: step time, peak RSS, step CPU s."""
    ratios: dict[str, Any] = {}
    trl = runs.get("trl", {}).get("summary")
    for name, entry in runs.items():
        if name == "trl" or trl is None or "summary" not in entry:
            continue
        ours = entry["summary"]
        ratios[f"{name}/trl"] = {
            "step_time": ours["median_step_s"] / trl["median_step_s"],
            "peak_rss": ours["peak_rss_bytes"] / trl["peak_rss_bytes"],
            "step_cpu_seconds": ours["median_step_cpu_s"] / trl["median_step_cpu_s"],
        }
    return ratios


def _ratios_over_first(names: list[str], runs: dict[str, Any]) -> dict[str, Any]:
    """Each configuration that ran against the first listed one that ran (e.g. LoRA and bf16
    against full fp32): step time, peak RSS, weight sync."""
    first = next((n for n in names if "summary" in runs.get(n, {})), None)
    over_first: dict[str, Any] = {}
    for name, entry in runs.items():
        if first is None or name == first or "summary" not in entry:
            continue
        base, ours = runs[first]["summary"], entry["summary"]
        over_first[f"{name}/{first}"] = {
            "step_time": ours["median_step_s"] / base["median_step_s"],
            "peak_rss": ours["peak_rss_bytes"] / base["peak_rss_bytes"],
            "weight_sync": (ours["phases_median_s"].get("weight_sync") or 0.0)
            / max(1e-9, base["phases_median_s"].get("weight_sync") or 0.0),
        }
    return over_first


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run each configuration, write the JSON with the ratios, print them; returns the JSON."""
    args = _parse(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    from trainer.models.loading import resolve_model

    model_path = resolve_model("smollm2-135m-instruct")
    settings = _settings(args)
    rows = arithmetic_rows(args.prompts_per_step * args.steps, seed=0)
    workdir = Path(tempfile.mkdtemp(prefix="bench-step-"))
    config_path = workdir / "config.json"
    config_path.write_text(
        json.dumps({"model_path": str(model_path), "rows": rows, "settings": settings}, indent=2)
    )

    runs = {name: _run_configuration(name, config_path, workdir, args) for name in names}
    ratios = _ratios_over_trl(runs)
    over_first = _ratios_over_first(names, runs)
    result = {
        "benchmark": "step_vs_trl",
        "command": "python -m bench.step_vs_trl "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(),
        "model_path": str(model_path),
        "settings": settings,
        "prompts": rows,
        "runs": runs,
        "ratios_ours_over_trl": ratios,
        "ratios_over_first": over_first,
        "workdir": str(workdir),
    }
    write_json(args.out, result)
    for key, value in [*ratios.items(), *over_first.items()]:
        print(
            f"{key}: step time {value['step_time']:.2f}x, peak RSS {value['peak_rss']:.2f}x",
            flush=True,
        )
    print(f"written to {args.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
