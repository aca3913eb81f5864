"""Run SmolLM2-135M on multiplication with and without a calculator tool, and plot both runs.

    python scripts/calculator_tool_run.py [--runs tool notool] [--steps N] [--plot-only]

Runs recipes/smollm2-calculator-tool.yaml and recipes/smollm2-calculator-notool.yaml one after
the other on CPU (the pieces of scripts/smollm2_run.py: each step and eval to
runs/smollm2-calculator-<run>/metrics.jsonl), copies the metrics to
docs/smollm2-calculator-<run>-metrics.jsonl and draws docs/smollm2-calculator-tool.png: held-out
accuracy (greedy; greedy episodes for the tool run) and the tool-call rate (``tools/calls``,
calls per training episode) over steps, both runs on one figure. ``--plot-only`` redraws it from
the docs/ metrics files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.smollm2_run import JsonlLog  # noqa: E402
from trainer.run.callbacks import CallbackList, ConsoleCallbacks  # noqa: E402
from trainer.run.cli import load_recipe  # noqa: E402
from trainer.run.loop import train  # noqa: E402

RUNS = ("tool", "notool")
DOCS = ROOT / "docs"
PLOT = DOCS / "smollm2-calculator-tool.png"


def recipe(run: str) -> Path:
    return ROOT / "recipes" / f"smollm2-calculator-{run}.yaml"


def docs_metrics(run: str) -> Path:
    return DOCS / f"smollm2-calculator-{run}-metrics.jsonl"


def read_log(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The step records (``step`` and its metrics, ``t``) and eval records of a metrics file
    that :class:`JsonlLog` wrote."""
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "step":
            steps.append({"step": record["step"], "t": record["t"], **record["metrics"]})
        elif record["kind"] == "eval":
            evals.append(record)
    return steps, evals


def run_one(run: str, steps: int | None) -> dict[str, Any]:
    spec = load_recipe(recipe(run), steps=steps)
    out = ROOT / "runs" / f"smollm2-calculator-{run}"
    log = JsonlLog(out / "metrics.jsonl")
    started = time.time()
    result = train(spec, CallbackList(ConsoleCallbacks(), log), output_dir=out)
    shutil.copyfile(log.path, docs_metrics(run))
    return {
        "run": run,
        "steps": result.final_step,
        "minutes": round((time.time() - started) / 60, 1),
        "evals": [(e["step"], e["accuracy"]) for e in log.evals],
    }


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, calls) = plt.subplots(1, 2, figsize=(11, 4))
    for run, color in zip(RUNS, ("tab:blue", "tab:orange"), strict=True):
        path = docs_metrics(run)
        if not path.exists():
            continue
        steps, evals = read_log(path)
        label = "with calculator" if run == "tool" else "without tools"
        acc.plot(
            [e["step"] for e in evals],
            [e["accuracy"] for e in evals],
            "o-",
            color=color,
            label=f"{label}: held-out accuracy (greedy)",
        )
        acc.plot(
            [s["step"] for s in steps],
            [s.get("reward/numeric/mean") for s in steps],
            ":",
            color=color,
            label=f"{label}: train reward",
        )
        calls.plot(
            [s["step"] for s in steps],
            [s.get("tools/calls", 0.0) for s in steps],
            "-",
            color=color,
            label=f"{label}: tool calls / episode",
        )
        if run == "tool":
            calls.plot(
                [s["step"] for s in steps],
                [s.get("tools/malformed", 0.0) for s in steps],
                "--",
                color=color,
                label=f"{label}: malformed calls / episode",
            )
    acc.set_xlabel("step")
    acc.set_ylim(-0.02, 1.02)
    acc.set_title("held-out accuracy (32 rows) and train reward")
    acc.legend(fontsize=8)
    calls.set_xlabel("step")
    temperature = load_recipe(recipe("tool")).grpo.temperature
    calls.set_title(f"tool calls per training episode (sampled at T={temperature:g})")
    calls.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, 2-3 digit multiplication, GRPO + LoRA on CPU")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--steps", type=int, default=None, help="override grpo.steps")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    if not args.plot_only:
        for run in args.runs:
            summary = run_one(run, args.steps)
            # One line with a fixed prefix: vLLM also logs to stdout.
            print(f"summary: {json.dumps(summary)}", flush=True)
    plot(PLOT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
