"""Run the SmolLM2-135M arithmetic recipe on CPU, log every step, and plot reward and KL.

    python scripts/smollm2_run.py [--recipe recipes/smollm2-arithmetic.yaml] [--out runs/smollm2]

Writes <out>/metrics.jsonl (one line per step, plus the eval events), docs/smollm2-arithmetic.png,
and prints the held-out accuracy before and after training.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobspec import JobSpec  # noqa: E402
from trainer.run.callbacks import CallbackList, Callbacks, ConsoleCallbacks  # noqa: E402
from trainer.run.loop import train  # noqa: E402


class JsonlLog(Callbacks):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.steps.append({"step": step, **metrics})
        self._write({"kind": "step", "step": step, "metrics": metrics, "t": time.time()})

    def on_event(
        self, kind: str, message: str, level: str = "info", data: dict[str, object] | None = None
    ) -> None:
        if kind == "eval" and data:
            self.evals.append(dict(data))
            self._write({"kind": "eval", **data})


def plot(log: JsonlLog, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log.steps]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, label in (
        ("reward/numeric/mean", "train reward (numeric)"),
        ("reward/mean", "train reward (total)"),
    ):
        ax1.plot(steps, [r.get(name) for r in log.steps], label=label)
    if log.evals:
        ax1.plot(
            [e["step"] for e in log.evals],
            [e["accuracy"] for e in log.evals],
            "o-",
            label="held-out accuracy (greedy)",
        )
    ax1.set_xlabel("step")
    ax1.set_ylim(0, 1)
    ax1.legend()
    ax1.set_title("reward and held-out accuracy")
    for name in ("kl", "kl_k3"):
        ax2.plot(steps, [r.get(name) for r in log.steps], label=name)
    ax2.set_xlabel("step")
    ax2.set_title("KL to the reference (per token)")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2-arithmetic.yaml"))
    parser.add_argument("--out", default=str(ROOT / "runs" / "smollm2-arithmetic"))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "smollm2-arithmetic.png"))
    args = parser.parse_args()
    spec = JobSpec.model_validate(yaml.safe_load(Path(args.recipe).read_text()))
    out = Path(args.out)
    log = JsonlLog(out / "metrics.jsonl")
    started = time.time()
    result = train(spec, CallbackList(ConsoleCallbacks(), log), output_dir=out)
    minutes = (time.time() - started) / 60
    plot(
        log, Path(args.plot), f"{spec.name}: SmolLM2-135M-Instruct, GRPO on CPU ({minutes:.0f} min)"
    )
    first, last = log.evals[0], log.evals[-1]
    # One line with a fixed prefix: vLLM also logs to stdout.
    summary = json.dumps(
        {
            "steps": result.final_step,
            "minutes": round(minutes, 1),
            "eval_accuracy_before": first["accuracy"],
            "eval_accuracy_after": last["accuracy"],
            "evals": log.evals,
            "checkpoint": str(result.checkpoint_path),
        }
    )
    print(f"summary: {summary}", flush=True)
    return 0 if last["accuracy"] > first["accuracy"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
